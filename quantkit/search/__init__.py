"""`quantkit search`: per-layer mixed precision under a size budget, judged on the worst domain (search/run.py)."""
