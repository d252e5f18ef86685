"""Runtime policies that choose each chunk's precision at prefill from the prompt itself (Cocktail); the settings and
codecs they use are declared in kvcal.methods."""
