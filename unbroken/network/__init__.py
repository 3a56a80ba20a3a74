"""network layer (see DESIGN.md)."""
