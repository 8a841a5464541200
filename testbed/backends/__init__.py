"""Where devices live: the table of backends (`table`), what every backend offers (`base`),
what shapes its devices' links (`traffic_control`), devices as processes in network
namespaces on this host (`local`), as Docker containers (`docker/`), as boards over SSH
(`ssh/`), and as boards reserved through EnOSlib (`enoslib/`).

Importing the package loads nothing (`python3 -m testbed.backends.docker.engine` runs before
any dependency is installed): callers import the module they need.
"""
