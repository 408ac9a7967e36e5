"""Planning a run before it loads: memory per GPU of every phase, and the time estimate."""
