"""The figures of a run directory, as PNG files readable without the code (see `make_figures`)."""
