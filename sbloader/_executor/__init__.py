"""The streaming executor: a non-blocking scheduling loop over Ray Core.

``policy`` holds the pure scheduling decisions (unit-tested without Ray),
``stages`` turns a dataset's operators into physical stages, ``tasks`` the code
that runs remotely, ``executor`` the loop that ties them together.
"""
