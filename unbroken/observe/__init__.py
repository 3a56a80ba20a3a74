"""observe layer (see DESIGN.md)."""
