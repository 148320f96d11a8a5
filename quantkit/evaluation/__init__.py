"""Quality measurements of a loaded model."""
