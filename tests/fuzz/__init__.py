"""The fuzz of the public API (marker ``fuzz``): see test_fuzz.py."""
