"""A stand-in for the parts of vLLM kvbm's connector imports (tests only)."""
