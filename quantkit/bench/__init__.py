"""`quantkit bench`: memory and tokens/s of an artifact against its original on the target device."""
