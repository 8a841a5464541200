"""Boards reserved and described by EnOSlib (`backend: enoslib`), run by the ssh backend's
machinery."""
