"""How kvcal wires a Hugging Face model for its own attention, shared by the runtime cache
(kvcal.runtime.cache) and the simulation (kvcal.simulate).

Through transformers' public extension points only: `AttentionInterface.register(name, function)` (and
the matching `AttentionMaskInterface` entry, so the model builds SDPA-style boolean masks for `name`) and
`model.set_attn_implementation(name)`. While wired, forward hooks record, per attention module, whether
its forward is running, the pre-RoPE keys of the running forward (the output of the key source, see
kvcal.adapters) and the position ids the rotary embedding was called with. A layer reading another's keys and
values (KV sharing, ModelAdapter.readers) has a slot of its own that serves the cache of the layer it reads: what a
cache hands that layer's attention in a forward it hands the readers too.

A wiring is idempotent and reference-counted per model: the first user snapshots the attention
implementation and installs the hooks; later users of the same kind share them; when the last user
unwires, in whatever order users unwire, the hooks go and the snapshot is restored. Users of different
kinds never share a model (a simulation inside an open cache is refused), and an exclusive kind (the
simulation, whose layers are attached to the modules) admits one user at a time. Everything is kept in
a registry keyed by the attention modules (weakly), not in attributes of the model.
"""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask
from transformers.utils import is_torch_greater_or_equal

from kvcal.adapters import ModelAdapter, decoder_of
from kvcal.errors import KvcalError

_WHAT: dict[str, str] = {}  # attention name -> what it is, for messages
_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> Slot


def register(name: str, function, what: str) -> None:
    """Make `function` transformers' attention implementation `name` (idempotent); `what` names it in errors."""
    if AttentionInterface().get(name) is not function:
        AttentionInterface.register(name, function)
    if name not in AttentionMaskInterface():  # SDPA's boolean masks: the attention reads padding from them
        AttentionMaskInterface.register(name, sdpa_mask)
    _WHAT[name] = what


def describe(name: str) -> str:
    return _WHAT.get(name, f"attention implementation '{name}'")


@dataclass(eq=False)
class Slot:
    """One attention module of a wired model."""

    wiring: Wiring
    index: int  # the adapter layer whose cache (or simulated layer) serves the module
    reader: bool = False  # the module reads layer `index`'s keys and values (KV sharing), keeping none of its own
    running: int = 0  # > 0 while the module's forward runs
    pre_rope_keys: torch.Tensor | None = None  # (batch, tokens, kv width) of the running forward
    latents: torch.Tensor | None = None  # (batch, tokens, latent channels) of the running forward, an MLA layer's values
    # the attention mask the module's forward was called with, where its indexer puts its pick in the mask its attention
    # is handed (LayerHandles.pick_in_mask): the step's, before the pick
    step_mask: torch.Tensor | None = None
    # the columns of the tokens each query attends (batch, queries, k; -1: none) that the layer's indexer returned, or
    # that its module was handed from an earlier layer's (LayerHandles.pick_returned)
    pick: torch.Tensor | None = None
    serving: object | None = None  # what a cache's update() hands to this forward's attention
    attached: object | None = None  # an exclusive user's per-layer object (the simulation's layer state)

    def take_serving(self):
        serving, self.serving = self.serving, None
        return serving


@dataclass(eq=False)
class Wiring:
    """A model wired for one attention implementation, with its users."""

    model: torch.nn.Module
    adapter: ModelAdapter
    name: str
    previous: str
    exclusive: bool
    users: list = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)  # one per adapter layer
    reader_slots: list[Slot] = field(default_factory=list)  # one per reader layer (ModelAdapter.readers)
    hooks: list = field(default_factory=list)
    # position ids the rotary is handed in the running forward: its tokens' (Qwen4-Exp's: every token's so far, the
    # step's last)
    positions: torch.Tensor | None = None
    # those positions hold image or video tokens' at multimodal RoPE positions (Qwen-VL's three rows differ)
    multimodal: bool = False
    # (batch, columns): which columns of the running step's mask (those cached before it, then its own) hold real
    # tokens, as the last indexer to run kept them (LayerHandles.pick_returned: GLM-5 Next's)
    real_columns: torch.Tensor | None = None

    def uses(self, owner) -> bool:
        return any(user is owner for user in self.users)

    def serve(self, index: int, serving) -> None:
        """Hand `serving` to layer `index`'s attention in the running forward, and to the layers reading its cache."""
        for layer_slot in [self.slots[index], *(s for s in self.reader_slots if s.index == index)]:
            layer_slot.serving = serving

    @property
    def switched(self) -> torch.nn.Module:
        """The module whose attention implementation the wiring switches: the model, or the decoder alone of a model
        whose decoder reads image tokens (ModelAdapter.images_as_tokens, image_blocks) or attends across to them
        (cross_attention), so that its vision tower keeps its own."""
        adapter = self.adapter
        with_images = adapter.images_as_tokens or adapter.image_blocks or bool(adapter.cross_attention)
        return decoder_of(self.model) if with_images else self.model

    def switch(self, name: str) -> None:
        """Switch the attention implementation of `switched` to `name`: of its text config alone where image and audio
        encoders sit inside the decoder's own module (ModelAdapter.encoders_inside), so that they keep their own."""
        _set_attention(self.switched, name, self.adapter.encoders_inside)

    def check_active(self) -> None:
        """Refuse to serve if the model's attention implementation was changed behind the wiring's back."""
        current = self.switched.config._attn_implementation
        if current != self.name:
            raise KvcalError(f"the model's attention implementation was changed to '{current}' while {describe(self.name)} "
                             f"was open on it; close that first, then change the attention implementation")


def slot(module: torch.nn.Module) -> Slot | None:
    """The wiring's record of an attention module, or None when its model is not wired."""
    return _SLOTS.get(module)


# what an attention call may ask that kvcal's attention does not compute, by the keyword transformers passes it as
_NOT_COMPUTED = {"softcap": "scores soft-capped", "s_aux": "attention sinks", "sinks": "attention sinks",
                 "indices": "the tokens an indexer picked", "block_indices": "the key blocks an indexer picked"}


def check_call(module: torch.nn.Module, layer_slot: Slot | None, attention_mask, tokens: int, kwargs: dict) -> None:
    """Refuse an attention call over `tokens` queries that kvcal's attention (the runtime cache's, the simulation's)
    would serve wrongly: from a part of a wired model outside its decoder's layers (outside_the_decoder), asking for
    what it does not compute (check_computed), or a step it would read causally where the model attends both ways
    (refuse_unmasked_step)."""
    if layer_slot is None and in_a_wired_model(module):
        raise KvcalError(outside_the_decoder(module))
    check_computed(module, kwargs, layer_slot)
    refuse_unmasked_step(module, attention_mask, tokens)


def check_computed(module: torch.nn.Module, kwargs: dict, layer_slot: Slot | None) -> None:
    """Refuse an attention call that asks for what kvcal's attention would otherwise leave out without a word: all
    but the sinks of a layer the adapter found them in (kvcal.adapters: gpt-oss's s_aux, which kvcal adds), the tokens
    an indexer picked for a layer the adapter found sparse (DeepSeek Sparse Attention's `indices`: chosen_columns) and
    the soft-cap of a model whose config gives that one (Gemma 2's, which the fits also applied)."""
    adapter = layer_slot.wiring.adapter if layer_slot is not None else None
    handles = adapter.layers[layer_slot.index] if adapter is not None else None
    softcap = adapter.softcap if adapter is not None else None
    sparse = handles is not None and handles.sparse
    served = {"s_aux": handles is not None and handles.sinks is not None, "indices": sparse, "block_indices": sparse,
              "softcap": softcap is not None}
    for name, what in _NOT_COMPUTED.items():
        if kwargs.get(name) is not None and not served.get(name, False):
            raise KvcalError(f"{type(module).__name__} asks its attention for {what} ('{name}'), which kvcal's attention "
                             "does not compute and would leave out")
    if softcap is not None and kwargs.get("softcap") != softcap:
        raise KvcalError(f"{type(module).__name__} asks its attention to soft-cap scores at {kwargs.get('softcap')}, its config "
                         f"at {softcap} (what kvcal computes and calibrated for); load the model with its own config")


def multimodal_refusal(pre_rope_layers: list[int]) -> str:
    """Why keys stored before RoPE cannot hold image tokens at multimodal RoPE positions."""
    return (f"the model was given image or video tokens, at multimodal RoPE positions (time, height and width); layers "
            f"{pre_rope_layers} store keys before RoPE, which kvcal rotates by one position each: use a bundle or method "
            "storing keys after RoPE (kivi, kvmix, an engine's cache type) for images")


def refuse_unmasked_step(module: torch.nn.Module, attention_mask, tokens: int) -> None:
    """Refuse a step of several tokens handed no mask by an attention that is not causal (PaliGemma's): transformers'
    SDPA would attend it both ways, where kvcal's reads no mask as causal."""
    if attention_mask is None and tokens > 1 and getattr(module, "is_causal", True) is False:
        raise KvcalError(f"{type(module).__name__} was handed {tokens} tokens without a mask, which it attends both ways "
                         "(a prefix LM's prompt); pass token_type_ids: 0 for the prompt's tokens (attended both ways), 1 "
                         "for text read causally")


def left_to_the_model(module: torch.nn.Module) -> bool:
    """Whether `module` is an attention layer of a wired decoder that kvcal leaves as the model runs it (Mllama's
    cross-attention, over an image's keys and values in transformers' own cache layer: ModelAdapter.cross_attention)."""
    return any(any(left is module for left in wiring.adapter.cross_attention.values())
               for wiring in {s.wiring for s in _SLOTS.values()})


def in_a_wired_model(module: torch.nn.Module) -> bool:
    """Whether `module` is a part of a wired model (which wires only its decoder's attention layers)."""
    return any(any(part is module for part in wiring.model.modules()) for wiring in {s.wiring for s in _SLOTS.values()})


def outside_the_decoder(module: torch.nn.Module) -> str:
    """Why a wired model's attention implementation refuses `module`, a part of it outside its decoder's layers."""
    return (f"{type(module).__name__} is not an attention layer of the model's text decoder, which is all kvcal serves "
            "(a vision tower runs when the model is given images): call the model with input_ids alone")


def wiring_of(adapter: ModelAdapter) -> Wiring | None:
    found = slot(adapter.layers[0].attention)
    return found.wiring if found is not None else None


def wire(model: torch.nn.Module, adapter: ModelAdapter, name: str, owner, exclusive: bool = False,
         attached: list | None = None) -> Wiring:
    """Wire `model` for attention implementation `name` (registered) on behalf of `owner`, or join its wiring.
    exclusive: no other user at the same time; attached: one object per layer, kept on the layer's Slot."""
    if name not in _WHAT:
        raise KvcalError(f"attention implementation '{name}' is not registered with kvcal.wiring.register")
    if attached is not None and not exclusive:
        raise KvcalError("only an exclusive wiring attaches per-layer objects")
    wiring = wiring_of(adapter)
    if wiring is not None:
        if wiring.name != name or wiring.exclusive or exclusive:
            raise KvcalError(f"this model is wired for {describe(wiring.name)}, which is still open; close it before "
                             f"opening {describe(name)} on the same model")
        if not wiring.uses(owner):
            wiring.users.append(owner)
        return wiring
    wiring = Wiring(model, adapter, name, "", exclusive, users=[owner])
    wiring.previous = wiring.switched.config._attn_implementation
    for index, handles in enumerate(adapter.layers):
        wiring.slots.append(Slot(wiring, index, attached=attached[index] if attached is not None else None))
    for reader in adapter.readers:
        wiring.reader_slots.append(Slot(wiring, reader.source, reader=True,
                                        attached=attached[reader.source] if attached is not None else None))
    _install_hooks(wiring)
    try:
        wiring.switch(name)
    except BaseException:
        _remove_hooks(wiring)
        raise
    for attention, layer_slot in _attention_slots(wiring):
        _SLOTS[attention] = layer_slot
    return wiring


def _attention_slots(wiring: Wiring) -> list[tuple[torch.nn.Module, Slot]]:
    """Each wired attention module (the adapter's layers', then its readers') and its slot."""
    modules = [handles.attention for handles in wiring.adapter.layers] + [reader.attention for reader in wiring.adapter.readers]
    return list(zip(modules, wiring.slots + wiring.reader_slots))


def unwire(wiring: Wiring, owner) -> None:
    """`owner` no longer uses the wiring (idempotent); the last user restores the model as it was."""
    if not wiring.uses(owner):
        return
    wiring.users = [user for user in wiring.users if user is not owner]
    if wiring.users:
        return
    for attention, layer_slot in _attention_slots(wiring):
        if _SLOTS.get(attention) is layer_slot:
            del _SLOTS[attention]
        layer_slot.attached = layer_slot.serving = layer_slot.pre_rope_keys = layer_slot.latents = None
        layer_slot.step_mask = layer_slot.pick = None
    wiring.real_columns = None
    _remove_hooks(wiring)
    wiring.switch(wiring.previous)


@contextmanager
def suspended(adapter: ModelAdapter):
    """Within the block a wired model runs the attention implementation it had before it was wired (an fp
    pass while a cache is open, see kvcal.runtime.fp_context); a model that is not wired is untouched."""
    wiring = wiring_of(adapter)
    if wiring is None:
        yield
        return
    wiring.check_active()
    wiring.switch(wiring.previous)
    try:
        yield
    finally:
        if wiring.users:  # the last user may have unwired inside the block, restoring `previous` itself
            wiring.switch(wiring.name)


def _set_attention(model: torch.nn.Module, name: str, text_only: bool) -> None:
    model.set_attn_implementation({"": name} if text_only else name)  # "": the top config alone, not its sub-configs
    if model.config._attn_implementation != name:  # transformers only warns for a model it cannot switch
        raise KvcalError(f"{type(model).__name__} does not let transformers switch its attention implementation to "
                         f"'{name}' (set_attn_implementation left '{model.config._attn_implementation}')")


def _install_hooks(wiring: Wiring) -> None:
    def keep_positions(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        # Qwen's multimodal RoPE takes (3, batch, tokens): a text token's three positions (time, height, width) are
        # the same, an image's differ (looked for where images can enter: steps of several tokens)
        multimodal = positions is not None and positions.dim() == 3
        wiring.multimodal = multimodal and positions.shape[-1] > 1 and not bool((positions == positions[:1]).all())
        wiring.positions = positions[0] if multimodal else positions

    if wiring.adapter.rotary is not None:  # (a model without RoPE needs no positions)
        wiring.hooks.append(wiring.adapter.rotary.register_forward_pre_hook(keep_positions, with_kwargs=True))
    for handles, layer_slot in zip(wiring.adapter.layers, wiring.slots):
        def enter(module, args, layer_slot=layer_slot):
            layer_slot.running += 1
            layer_slot.serving = layer_slot.pre_rope_keys = layer_slot.latents = None

        def leave(module, args, output, layer_slot=layer_slot):
            layer_slot.running -= 1
            layer_slot.serving = layer_slot.pre_rope_keys = layer_slot.latents = layer_slot.step_mask = None
            layer_slot.pick = None

        def keep_keys(module, args, output, layer_slot=layer_slot, handles=handles):
            layer_slot.pre_rope_keys = handles.source_rows("k", output.detach())

        def keep_latents(module, args, output, layer_slot=layer_slot, handles=handles):
            layer_slot.latents = handles.source_rows("v", output.detach())

        wiring.hooks += [handles.attention.register_forward_pre_hook(enter),
                         handles.attention.register_forward_hook(leave, always_call=True),
                         handles.key_source.register_forward_hook(keep_keys)]
        if handles.latent is not None:  # (the attention is handed the values made from it, not the latent)
            wiring.hooks.append(handles.value_source.register_forward_hook(keep_latents))
        if handles.pick_in_mask:
            def keep_step_mask(module, args, kwargs, layer_slot=layer_slot, at=_mask_argument(handles.attention)):
                layer_slot.step_mask = kwargs["attention_mask"] if "attention_mask" in kwargs else args[at]

            wiring.hooks.append(handles.attention.register_forward_pre_hook(keep_step_mask, with_kwargs=True))
        if handles.pick_returned:
            wiring.hooks += _returned_pick_hooks(wiring, handles, layer_slot)
    for reader, layer_slot in zip(wiring.adapter.readers, wiring.reader_slots):
        def enter_reader(module, args, layer_slot=layer_slot):  # (keeps what the layer it reads was served)
            layer_slot.running += 1

        def leave_reader(module, args, output, layer_slot=layer_slot):
            layer_slot.running -= 1
            layer_slot.serving = None

        wiring.hooks += [reader.attention.register_forward_pre_hook(enter_reader),
                         reader.attention.register_forward_hook(leave_reader, always_call=True)]


def _returned_pick_hooks(wiring: Wiring, handles, layer_slot: Slot) -> list:
    """The hooks reading a layer's pick as GLM-5 Next's (LayerHandles.pick_returned; transformers calls its modules
    with keywords): its indexer's output, the indexer reading the cache through _StepCounted, and the step's real
    columns the indexer kept (Wiring.real_columns: its states' last channel, or without a cache its mask); where it runs
    no indexer, the prev_topk_indices its attention is handed."""
    def keep_handed_pick(module, args, kwargs):
        layer_slot.pick = kwargs.get("prev_topk_indices")

    if handles.indexer is None:
        return [handles.attention.register_forward_pre_hook(keep_handed_pick, with_kwargs=True)]

    def count_the_step(module, args, kwargs):
        if kwargs.get("cache") is not None:
            kwargs["cache"] = _StepCounted(kwargs["cache"])
        return args, kwargs

    def keep_pick(module, args, kwargs, output):
        layer_slot.pick, cache = output, kwargs.get("cache")
        wiring.real_columns = kwargs["attention_mask"].bool() if cache is None else cache.kept[..., -1] != 0

    return [handles.indexer.register_forward_pre_hook(count_the_step, with_kwargs=True),
            handles.indexer.register_forward_hook(keep_pick, with_kwargs=True)]


class _StepCounted:
    """A cache as GLM-5 Next's indexer reads it within a step, where transformers' own cache has already stored the
    step (its attention's update came first; kvcal's cache stores it as it attends): update_indexer keeps the step's
    indexer states (-> every token's so far, `kept`), and its layer (`layers[i]`, this view: keys.shape[-2],
    get_seq_length()) counts them."""

    def __init__(self, cache):
        self.cache, self.kept = cache, None
        self.layers = defaultdict(lambda: self)

    def update_indexer(self, states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.kept = self.cache.update_indexer(states, layer_idx)
        return self.kept

    @property
    def keys(self) -> torch.Tensor:
        return self.kept.new_empty(self.kept.shape[0], 1, self.kept.shape[1], 0)  # (a length, no channels)

    def get_seq_length(self) -> int:
        return self.kept.shape[1]


def with_cache(module: torch.nn.Module, args: tuple, kwargs: dict, cache_for) -> tuple[tuple, dict]:
    """(args, kwargs) of a call of `module` (a forward pre-hook's, with_kwargs) whose `cache` argument, handed by
    position or by keyword (an indexer's: transformers calls some by position), is cache_for(that argument, or None)."""
    at = list(inspect.signature(module.forward).parameters).index("cache")
    if at < len(args):
        return (*args[:at], cache_for(args[at]), *args[at + 1:]), kwargs
    return args, {**kwargs, "cache": cache_for(kwargs.get("cache"))}


def _mask_argument(attention: torch.nn.Module) -> int:
    """Where `attention_mask` sits among the positional arguments of the attention module's forward (which
    kvcal.adapters found it takes, LayerHandles.pick_in_mask)."""
    return list(inspect.signature(attention.forward).parameters).index("attention_mask")


def _remove_hooks(wiring: Wiring) -> None:
    for hook in wiring.hooks:
        hook.remove()
    wiring.hooks = []


# transformers' SDPA mask fills a row that sees nothing (padding) with True on torch < 2.5, where SDPA gave NaN for it
PADDING_SEES_ALL = not is_torch_greater_or_equal("2.5")


def _padding_sees_all(asked: bool | None) -> bool:
    """Whether the masks read let padding see every column: `asked`, or this torch's where None."""
    return PADDING_SEES_ALL if asked is None else asked


def visible(attention_mask) -> torch.Tensor:
    """(batch, m, n): which of the n tokens each of the step's m rows sees, from its 4-D mask (boolean or additive)."""
    mask = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask
    return mask if mask.dtype == torch.bool else mask == 0


def chosen_columns(kwargs: dict, columns: int, block: int = 1) -> torch.Tensor | None:
    """(batch, groups, queries, columns): which of the step's key columns (those of its 4-D mask: the tokens cached
    before it, padding included, then its own) each query attends (groups 1: every head alike, else per group of query
    heads in order), of what a sparse layer's indexer picked (kvcal.adapters.LayerHandles.sparse), as its attention
    call hands it over: DeepSeek Sparse Attention's `indices` (batch, queries, k), the top k tokens by its scores
    (among them masked columns where a query sees fewer than k); MiniMax-M3's `block_indices` (batch, groups, queries,
    k), the top k blocks of `block` columns (-1: none, where a query sees fewer than k). None where it picked every
    column (as many as there are) or is none."""
    indices, blocks = kwargs.get("indices"), kwargs.get("block_indices")
    if indices is not None:
        if indices.shape[-1] >= columns:
            return None
        chosen = torch.zeros(*indices.shape[:2], columns, dtype=torch.bool, device=indices.device)
        return chosen.scatter_(-1, indices.long(), True)[:, None]
    count = -(-columns // block)
    if blocks is None or blocks.shape[-1] >= count:
        return None
    return _named(blocks, count).repeat_interleave(block, -1)[..., :columns]


def _named(index: torch.Tensor, count: int) -> torch.Tensor:
    """(..., count) booleans: which of `count` columns (or blocks) each row of `index` (..., k) names; -1 names none."""
    named = torch.zeros(*index.shape[:-1], count + 1, dtype=torch.bool, device=index.device)  # (the last: -1's)
    return named.scatter_(-1, index.long().masked_fill(index < 0, count), True)[..., :count]


def step_mask_and_pick(layer_slot: Slot, attention_mask, kwargs: dict, columns: int):
    """(the step's mask, the indexer's pick) of an attention call of layer_slot's over `columns` key columns: its mask
    and the pick handed beside it (chosen_columns); or where the layer's indexer puts its pick inside the mask
    (LayerHandles.pick_in_mask, Qwen4-Exp's), the mask its module was called with (Slot.step_mask) and, as
    chosen_columns gives it, (batch, 1, queries, columns) which columns the mask handed to the attention shows, None
    where that is every one the step's mask shows."""
    handles = layer_slot.wiring.adapter.layers[layer_slot.index]
    if handles.pick_returned:
        return _returned_step_mask_and_pick(layer_slot, columns)
    if not handles.pick_in_mask:
        return attention_mask, chosen_columns(kwargs, columns, handles.pick_block)
    step_mask = layer_slot.step_mask
    picked = visible(attention_mask)
    return step_mask, None if torch.equal(picked, visible(step_mask)) else picked[:, None]


def _returned_step_mask_and_pick(layer_slot: Slot, columns: int):
    """(the step's mask, the pick) of a layer whose indexer returns its pick (LayerHandles.pick_returned), its attention
    handed a mask over the keys the cache hands back: the step's real columns (Wiring.real_columns) each query sees
    causally, (batch, 1, queries, columns); and of those, the ones its pick names, None where that is every one."""
    real, pick = layer_slot.wiring.real_columns, layer_slot.pick
    if pick is None or real is None or real.shape[-1] != columns:
        raise KvcalError(f"layer {layer_slot.index} attended without the pick of an indexer run in this step over its "
                         f"{columns} columns; call the model's forward, which runs them in order")
    m = pick.shape[1]
    step_mask = real[:, None, :] & torch.ones(m, columns, dtype=torch.bool, device=real.device).tril(columns - m)
    chosen = _named(pick.masked_fill(pick >= columns, -1), columns) & step_mask  # (past the keys: none, as the model's)
    return step_mask[:, None], None if torch.equal(chosen, step_mask) else chosen[:, None]


def real_tokens(attention_mask, batch: int, m: int, device, padding_sees_all: bool | None = None) -> torch.Tensor:
    """(batch, m): which of the step's m new tokens are real (not padding), from the 4-D mask of the step.

    A real token sees itself (its own column, the (n - m + i)-th of row i); padding sees nothing. Where padding
    sees every column instead (torch < 2.5), a real token is one that does not see the next token of the step: with
    left padding (what generate() uses) that tells every row apart; only a right-padded last token of a step would be
    taken for a real one, and an image's tokens, which see the next (own_tokens_ahead), for padding (refused there).
    padding_sees_all: None, as this torch's masks (PADDING_SEES_ALL)."""
    if attention_mask is None:
        return torch.ones(batch, m, dtype=torch.bool, device=device)
    seen = visible(attention_mask)
    rows, own = torch.arange(m, device=seen.device), seen.shape[-1] - m + torch.arange(m, device=seen.device)
    valid = seen[:, rows, own].clone()
    if _padding_sees_all(padding_sees_all):
        valid[:, :-1] &= ~seen[:, rows[:-1], own[:-1] + 1]
    return valid.expand(batch, m)


def own_tokens_ahead(attention_mask, valid: torch.Tensor, padding_sees_all: bool | None = None) -> torch.Tensor | None:
    """(batch, q, q): which of the step's real tokens (`valid`, real_tokens') each real token of the mask's q queries
    (the step's last q: all of them, or a KV-sharing layer's kept ones) sees after itself, from its 4-D mask: an
    image's tokens, which Gemma 3's and 4's decoders attend to both ways (ModelAdapter.image_blocks); None where no
    token sees one, as in every causal step."""
    if attention_mask is None:
        return None
    seen = visible(attention_mask)
    q = seen.shape[1]
    if q == 1:
        return None
    own, valid = seen[..., -q:], valid[:, -q:]
    rows = torch.arange(q - 1, device=own.device)
    if not bool((own[:, rows, rows + 1] & valid[:, :-1] & valid[:, 1:]).any()):  # an image's first tokens see their next
        return None
    if _padding_sees_all(padding_sees_all):
        raise KvcalError("a step whose tokens see later ones (an image's, attended both ways) needs torch >= 2.5, whose "
                         "masks tell them from padding; upgrade torch")
    return own & torch.ones(q, q, dtype=torch.bool, device=own.device).triu(1) & valid[:, :, None] & valid[:, None, :]
