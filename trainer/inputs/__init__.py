"""What a run reads: the base model's files and text encoders, and the data it prepares into a cache."""
