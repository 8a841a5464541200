"""The testbed orchestrator (DESIGN.md section 5). Must not import torch at import time."""
