"""Engine versions and the children that serve them; ``engines/DESIGN.md`` maps the modules."""
