"""The calibrated fits behind the recipes: KVQuant codebooks and the Fisher knapsack (`nuq`), SKVQ channel groups and
clipping (`skvq`), KVmix's per-layer widths (`kvmix`). The recipes that use them are in kvcal.methods."""
