"""What a run hands on: the exported T5 weights file, its model card, and the Hub upload."""
