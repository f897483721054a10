"""Build hook for the one C extension: ``sbloader.sources._jpegwindow`` (metadata is in setup.cfg).

It links the system's libjpeg-turbo (``libjpeg62-turbo-dev`` / ``libjpeg-turbo-devel``)
for its window decode. It is optional: without a compiler or the headers the build
goes on without it and ``sbloader.transforms`` decodes every image whole, with Pillow.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("sbloader.sources._jpegwindow", ["sbloader/sources/_jpegwindow.c"],
                             libraries=["jpeg"], optional=True, extra_compile_args=["-O2"])])
