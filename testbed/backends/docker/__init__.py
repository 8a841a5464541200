"""Devices as Docker containers (`backend`), the worker image they run (`image`, built from a
local base image, `base_image`, of the host's own Debian or Ubuntu suite, `suite`, and a
wheelhouse, `wheelhouse`, by `image_steps`), and the Docker engine itself (`engine`:
`python3 -m testbed.backends.docker.engine up`, standard library only, so that this package's
`__init__` must stay empty of imports).
"""
