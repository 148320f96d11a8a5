"""Scripts run under another environment's interpreter (vLLM's venv), where quantkit is not installed."""
