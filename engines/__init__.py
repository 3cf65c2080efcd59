"""Engine versions and the children that serve them (see issue 3; nothing here yet)."""
