"""kvcal.model_caches: the cache a model's decoder takes, MiniMax's own class where it refuses any other."""

import torch
from transformers import DynamicCache

from helpers.tiny_models import tiny_model
from kvcal.model_caches import cache_argument, model_cache, taking
from kvcal.runtime.cache import WiredCache


def test_a_model_without_a_cache_class_of_its_own_takes_the_class_as_it_is():
    assert taking(DynamicCache, "llama") is DynamicCache and taking(WiredCache, "qwen3_5_text") is WiredCache
    assert type(model_cache(tiny_model("llama"))) is DynamicCache


def test_minimax_decodes_over_its_states_in_cache_layers_as_over_its_own_cache():
    """MiniMax refuses any cache but a MiniMaxCache: the class taken is one, its lightning attention layers' states in
    its layers' recurrent states (none before a forward); a prefill then token by token gives the logits MiniMax's own
    cache gives (each step given its positions, as generate() gives them: MiniMax's own counts the tokens its first
    layer stored, none where that is a lightning one)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model = tiny_model("minimax")
    assert issubclass(taking(WiredCache, "minimax"), WiredCache) and issubclass(taking(WiredCache, "minimax"), MiniMaxCache)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.inference_mode():
        for cache in (model_cache(model), MiniMaxCache()):
            assert isinstance(cache, MiniMaxCache) and cache.get_linear_cache(0) is None
            steps = [model(ids[:, :12], **cache_argument(cache), use_cache=True).logits]
            steps += [model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True, position_ids=torch.tensor([[t]])).logits
                      for t in range(12, 20)]
            logits.append(torch.cat(steps, 1))
            assert cache.get_linear_cache(0).shape == (2, 4, 16, 16)  # (batch, heads, head_dim, head_dim)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
