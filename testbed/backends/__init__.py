"""Where devices live: the table of backends (`table`), what every backend offers (`base`),
devices as processes in network namespaces on this host (`local`), as Docker containers
(`docker/`), and as boards over SSH (`ssh/`).

Importing the package loads nothing (`python3 -m testbed.backends.docker.engine` runs before
any dependency is installed): callers import the module they need.
"""
