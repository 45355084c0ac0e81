"""moeflow.parallel.hf_loop reads how a base model's forward runs its layers from its source: hand-written
forwards of each shape it tells apart, checked field by field (the classes are never run)."""

from __future__ import annotations

from torch import nn

from moeflow.parallel.hf_loop import carried_state, layer_loop


class Shared(dict):
    pass


class Plain(nn.Module):
    def forward(self, input_ids, cache=None):
        hidden = self.embed_tokens(input_ids) * self.scale
        rope = self.rotary_emb(hidden)
        for layer in self.layers:
            hidden = layer(hidden, rope, cache=cache)  # the caller's cache is an argument, not shared state
        return self.head(self.norm(hidden))


class Carrying(nn.Module):
    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        per_layer = self.per_layer(input_ids)  # read into what the layers take beside the hidden states
        selection, router = None, None
        for i, layer in enumerate(self.layers):
            hidden, selection, router = layer(hidden, router, per_layer[i], prev_selection=selection,
                                              input_ids=input_ids)
        return self.hc_head(hidden)


class SharingKV(nn.Module):
    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        shared = Shared()
        for layer in self.layers:
            hidden = layer(hidden, shared_kv=shared)
        return hidden


class Accumulating(nn.Module):
    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        blocks = hidden[:, :, None]
        for layer in self.layers:
            new = layer(hidden, blocks)
            blocks = blocks + new[:, :, None]
            hidden = new
        return self.final(blocks, hidden)


def test_a_plain_loop_carries_nothing_and_places_what_runs_before_and_after_it():
    loop = layer_loop(Plain)
    assert (loop.carried, loop.slots, loop.unsupported, loop.reads_ids) == ((), (), "", False)
    assert loop.before == {"embed_tokens", "scale"}  # the rotary table goes to the layers beside the hidden states
    assert loop.after == {"head", "norm"}
    assert carried_state(Plain) is None


def test_what_a_layer_returns_for_the_next_goes_back_by_position_or_keyword():
    loop = layer_loop(Carrying)
    assert loop.carried == ("selection", "router")
    assert loop.slots == ("prev_selection", 1)
    assert loop.unsupported == "" and loop.reads_ids
    assert loop.before == {"embed_tokens"}  # not per_layer: its output goes to the layers beside the hidden states
    assert loop.after == {"hc_head"}
    assert carried_state(Carrying) == "hidden, selection, router = layer(hidden, router, per_layer[i], " \
                                      "prev_selection=selection,"


def test_state_shared_other_than_through_the_outputs_is_named():
    sharing = layer_loop(SharingKV)  # whether a split must carry it is the config's say (hf_pipeline.kv_sources)
    assert sharing.unsupported == "" and sharing.shared == "shared"
    assert sharing.sharing == "its layers share `shared` (Shared), which they write into and read back"
    assert layer_loop(Accumulating).shared == ""
    assert layer_loop(Accumulating).unsupported == (
        "its loop builds `blocks` from the layers' outputs and hands it to the later layers")
