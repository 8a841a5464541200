"""Devices on real boards over SSH: `backend` (the backend), `session` (connecting with host
keys checked, commands and SFTP on one board), `checks` (what a board must have), `files`
(the source archive and which files a board lacks), `scripts` (the Python programs run on a
board), `shaping` (tc, ip and ethtool as root, and what unshaping restores).
"""
