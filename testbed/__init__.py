"""The testbed orchestrator (docs/architecture.md). Must not import torch at import time."""
