"""The S3-compatible server of ``bench_remote.py``, in a process of its own (so moto's
request handling does not compete with the measured loader's process for its GIL).

Starts moto on 127.0.0.1 and one fault proxy per latency given, prints one JSON line
``{"moto": "<endpoint>", "proxies": {"<latency ms>": "<endpoint>", ...}}`` and serves until
its standard input closes. Each proxy answers its counts at ``STATS_PATH``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3_server import S3Server, start_proxy  # noqa: E402


def main() -> None:
    latencies_ms = [float(x) for x in sys.argv[1:]] or [0.0]
    server = S3Server.start()
    proxies = {}
    for ms in latencies_ms:
        httpd, _ = start_proxy(server.moto_port, latency_s=ms / 1000.0)
        proxies[f"{ms:g}"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    print(json.dumps({"moto": f"http://127.0.0.1:{server.moto_port}", "proxies": proxies}), flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main()
