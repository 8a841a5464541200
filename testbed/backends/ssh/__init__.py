"""Devices on real boards over SSH: `backend` (the backend), `inventory` (its section of the
experiment: the boards), `refusal` (the inventory's rules), `session` (connecting with host
keys checked, commands and SFTP on one board), `checks` (what a board must have), `files`
(the source archive and which files a board lacks), `scripts` (the Python programs run on a
board), `shaping` (tc, ip and ethtool as root, and what unshaping restores),
`traffic_control` (the shaping plan as tc commands on each board, what the backend hands the
run's links), `leftovers` (what a run changed on its boards).
"""
