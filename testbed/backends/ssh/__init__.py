"""Devices on real boards over SSH: `backend` (the backend), `inventory` (its section of the
experiment: the boards), `refusal` (the inventory's rules), `session` (connecting with host
keys checked, commands and SFTP on one board), `checks` (what a board must have), `files`
(the source archive and which files a board lacks), `scripts` (the Python programs run on a
board), `shaping` (tc, ip and ethtool as root, and what unshaping restores), `leftovers`
(what a run changed on its boards).
"""
