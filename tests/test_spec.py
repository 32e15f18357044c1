"""Speculative decoding is exact: greedy output equals plain decoding token for token, and every cache holds exactly
the committed history afterwards."""
from pathlib import Path

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.layers.attention import slots_for
from eyas.loader.eagle import load_draft
from helpers import assert_draft_state, dense_kv, paged_kv, write_mirror_pair, write_random_draft, write_tiny_llama

SPECS = ["chain:1", "chain:4", "tree:8", "tree:mc_sim_7b_63", "dyn:k3d4n8",
         "dispatch:2=tree:8,4=dyn:k3d4n8,64=chain:2"]  # static, dynamic and chain steps by batch size, as shipped


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("random")
    target = write_tiny_llama(d / "t", vocab=17, hidden=32, heads=4, kv_heads=2, layers=2)
    return target, write_random_draft(d / "d", target, layers=1)


@pytest.fixture(scope="module")
def mirror_pair(tmp_path_factory):
    return write_mirror_pair(tmp_path_factory.mktemp("mirror"), vocab=24, layers=2)


def prompts6():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 17, (n,), generator=g).tolist() for n in (1, 2, 5, 9, 16, 23)]


def plain(target, prompts, params):
    return [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(prompts, params)]


@pytest.mark.parametrize("pair", ["random_pair", "mirror_pair"])
@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_plain(request, pair, spec):
    target, draft = request.getfixturevalue(pair)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = plain(target, prompts6(), params)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec)
    outs = llm.generate(prompts6(), params)  # 6 sequences of different lengths together
    assert [o.token_ids for o in outs] == ref
    assert llm.generate([prompts6()[3]], params)[0].token_ids == ref[3]  # batch size 1
    tpc = sum(o.stats.committed for o in outs) / sum(o.stats.target_calls for o in outs)
    if pair == "mirror_pair" and spec != "chain:1":
        assert tpc > 2.0, tpc  # long paths were accepted, so the deep code paths ran
    # with the pool forced to preempt
    small = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec,
                num_blocks=24, block_size=4)
    assert [o.token_ids for o in small.generate(prompts6(), params)] == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.blocks.num_used == 0


@pytest.mark.parametrize("pair", ["random_pair", "mirror_pair"])
@pytest.mark.parametrize("spec", SPECS)
def test_seeded_sampling_equals_plain(request, pair, spec):
    """Sampled speculative output equals seeded plain decoding token for token (`accept_tree_race`: a child is
    accepted iff it is the token plain decoding draws there), with and without filters, in a batch, in another
    order, and alone."""
    target, draft = request.getfixturevalue(pair)
    params = [SamplingParams(temperature=[1.0, 0.7, 1.3][s % 3], top_p=0.8 if s % 2 else 1.0, top_k=5 if s == 4 else -1,
                             max_tokens=30, seed=s, ignore_eos=True) for s in range(6)]
    ref = plain(target, prompts6(), params)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=spec)
    outs = llm.generate(prompts6(), params)
    assert [o.token_ids for o in outs] == ref
    assert [o.token_ids for o in llm.generate(prompts6()[::-1], params[::-1])][::-1] == ref
    assert [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts6(), params)] == ref
    if pair == "mirror_pair" and spec != "chain:1":
        assert sum(o.stats.committed for o in outs) / sum(o.stats.target_calls for o in outs) > 1.5


def test_stops_inside_an_accepted_run(mirror_pair):
    target, draft = mirror_pair
    ref = plain(target, prompts6(), SamplingParams(max_tokens=30, ignore_eos=True))
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:4")
    # max_tokens cuts an accepted run short
    outs = llm.generate(prompts6(), SamplingParams(max_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:7] for r in ref]
    # a stop token inside an accepted run ends the output right after it
    stop = ref[2][5]
    outs = llm.generate(prompts6(), SamplingParams(max_tokens=30, stop_token_ids=[stop]))
    for o, r in zip(outs, ref):
        expect = r[: r.index(stop) + 1] if stop in r else r
        assert o.token_ids == expect


# batches of 3 run plain steps: the draft only reads the committed pairs, and its cache must still be exact
@pytest.mark.parametrize("spec", ["chain:4", "tree:mc_sim_7b_63", "dispatch:2=chain:4,8=plain", "dyn:k3d4n8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_hold_exactly_the_committed_history(mirror_pair, spec, temperature):
    target_dir, draft_dir = mirror_pair
    llm = LLM(str(target_dir), device="cpu", dtype="float32", draft=str(draft_dir), speculation=spec,
              block_size=4)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=200, seed=7, ignore_eos=True))
            for p in prompts6()[2:5]]
    for _ in range(12):
        engine.step()
    target, draft = llm.target, llm.draft
    for seq in seqs:
        assert not seq.finished and seq.stats.target_calls > 0
        n = seq.num_cached
        assert n == len(seq.token_ids) - 1
        ids = torch.tensor([seq.token_ids[:n]])
        pos = torch.arange(n)[None]
        hidden = {}

        def run_target():
            hidden["h"] = target(ids, pos)
            return pos

        ref = dense_kv(target.model.layers, target.rope, run_target)
        for layer, (k, v) in enumerate(ref):
            pk, pv = paged_kv(engine.runner.cache, layer, seq.block_table, n, 4)
            torch.testing.assert_close(pk, k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pv, v, atol=1e-5, rtol=1e-5)
        # draft: pairs (x_{t+1}, h_t) for t < num_draft_cached, with the target's true features, and the features
        # h_t it has still to read waiting in the sequence's slot
        assert 0 < seq.num_draft_cached <= n
        assert_draft_state(engine, seq, target, draft, hidden["h"], 4)
    for seq in seqs:
        engine.abort(seq.request_id)
    assert engine.blocks.num_used == 0


def test_draft_mismatch_is_refused(tmp_path, random_pair):
    target, _ = random_pair
    other = write_tiny_llama(tmp_path / "o", vocab=23, hidden=32, heads=4, kv_heads=2)
    bad = write_random_draft(tmp_path / "bad", other)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(target), device="cpu", dtype="float32", draft=str(bad), speculation="chain:2")
    wide = write_tiny_llama(tmp_path / "w", vocab=17, hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="hidden size"):
        LLM(str(target), device="cpu", dtype="float32", draft=str(write_random_draft(tmp_path / "bw", wide)),
            speculation="chain:2")
    with pytest.raises(ValueError, match="draft"):
        LLM(str(target), device="cpu", dtype="float32", speculation="chain:2")
    with pytest.raises(ValueError, match="preset"):
        LLM(str(target), device="cpu", dtype="float32", draft=str(_), speculation="tree:nope")


def test_eagle_checkpoint_layouts(tmp_path, random_pair):
    """pytorch_model.bin with a `model.` prefix-free EAGLE layout loads like safetensors."""
    from safetensors.torch import load_file
    target, draft_dir = random_pair
    llm = LLM(str(target), device="cpu", dtype="float32")
    a = load_draft(draft_dir, llm.target)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((draft_dir / "config.json").read_text())
    sd = load_file(str(draft_dir / "model.safetensors"))
    sd["embed_tokens.weight"] = torch.zeros(17, 32)  # EAGLE checkpoints may carry an embedding: ignored
    torch.save(sd, bin_dir / "pytorch_model.bin")
    b = load_draft(bin_dir, llm.target)
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert "input_layernorm" not in "".join(n for n, _ in a.named_parameters() if n.startswith("layers.0."))


@pytest.mark.slow
def test_real_pair_smollm2_with_its_draft(smollm2):
    """SmolLM2 with the draft trained for it (eyas/drafts/smollm2): greedy speculative output equals plain decoding
    on 5 MT-Bench prompts, 64 tokens each, and speculation commits more than one token per target call."""
    from conftest import mt_bench_first_turns
    convs = [[{"role": "user", "content": q}] for q in mt_bench_first_turns(5)]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    ref = [o.token_ids for o in smollm2.chat(convs, params)]
    spec = LLM("smollm2", device="cpu", dtype="float32", draft="default", speculation="tree:mc_sim_7b_63")
    outs = spec.chat(convs, params)
    assert [o.token_ids for o in outs] == ref
    tpc = sum(o.stats.committed for o in outs) / sum(o.stats.target_calls for o in outs)
    assert tpc > 1.0, tpc


def _old_decode_inputs(seqs, P, W, with_draft):
    """The per-field construction the packed inputs replaced (one tensor per field, per-sequence rows)."""
    def padded(rows, Q):
        out = torch.zeros(len(rows), Q, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out
    p = [s.params for s in seqs]
    return dict(
        root_tokens=torch.tensor([s.token_ids[-1] for s in seqs]),
        num_cached=torch.tensor([s.num_cached for s in seqs]),
        num_draft_cached=torch.tensor([s.num_draft_cached for s in seqs]),
        block_tables=padded([s.block_table for s in seqs], W),
        catchup_tokens=padded([s.token_ids[s.num_draft_cached + 1: s.num_cached + 1] for s in seqs], P)
        if with_draft else None,
        temperature=torch.tensor([x.temperature for x in p], dtype=torch.float32),
        top_k=torch.tensor([x.top_k for x in p], dtype=torch.long),
        top_p=torch.tensor([x.top_p for x in p], dtype=torch.float32),
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.long),
        slots=torch.tensor([s.slot for s in seqs], dtype=torch.long))


@pytest.mark.parametrize("spec", [None, "chain:3"])
def test_packed_inputs_equal_the_per_field_ones_and_pad_the_rest(mirror_pair, spec):
    """The packed step inputs (one buffer, one copy; what a CUDA graph replay reads) equal the per-field construction
    row for row; rows past the batch are padding (zero block tables, so their writes go to the scratch block; the
    scratch hidden slot; top_p 1), also after a larger batch used the same buffer. A packer keeps its per-slot rows
    (slots, block tables, sampling parameters) while the batch's slots and the runner's slot_epoch stay the same:
    checked on a repeated batch, after block tables grew through another packer (the engine's own steps), and after
    a slot was reclaimed by a request of other parameters in the same row."""
    target, draft = mirror_pair
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft) if spec else None, speculation=spec,
              block_size=4)
    engine, runner = llm.engine, llm.engine.runner
    params = [SamplingParams(temperature=0.5 * i, top_p=1 - 0.1 * i, top_k=[-1, 5, 9, 3][i], max_tokens=50, seed=3 + i)
              for i in range(4)]
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts6()[1:5], params)]
    for _ in range(5):
        engine.step()
    assert all(s.num_output > 0 for s in seqs)
    B = 8

    def check(batch):
        inp = runner.decode_inputs(batch, B)
        ref = _old_decode_inputs(batch, runner.lookahead, runner.width, spec is not None)
        n = len(batch)
        for name, v in ref.items():
            got = getattr(inp, name)
            if v is None:
                assert got is None
                continue
            assert got.shape[0] == B and got.dtype == v.dtype, name
            assert torch.equal(got[:n], v), name
            pad = {"top_p": 1.0, "slots": runner.num_slots}.get(name, 0)
            assert (got[n:] == pad).all(), name
        assert inp.max_context_len == max(s.num_cached for s in batch)
        # the slots and positions packed on the host are the device formulas' (`slots_for`), padding rows included
        P, bs = runner.lookahead, runner.block_size
        ar = torch.arange(P)[None, :]
        bt, nc, nd = inp.block_tables.cpu(), inp.num_cached.cpu(), inp.num_draft_cached.cpu()
        assert torch.equal(inp.commit_slots.cpu(), slots_for(bt, nc[:, None] + ar, torch.ones(B, P, dtype=torch.bool),
                                                             bs))
        if spec is not None:
            lens = nc - nd
            valid = ar < lens[:, None]
            assert (lens[:n] >= 1).all() and (lens[n:] == 0).all()
            assert torch.equal(inp.catchup_lens.cpu(), lens)
            assert torch.equal(inp.catchup_positions.cpu(), torch.where(valid, nd[:, None] + ar, 0))
            assert torch.equal(inp.catchup_slots.cpu(), slots_for(bt, nd[:, None] + ar, valid, bs))

    for batch in (seqs, seqs[1:3], seqs[1:3], seqs):  # smaller after larger in one 8-row buffer; repeats
        check(batch)
    tables = [list(s.block_table) for s in seqs]
    for _ in range(6):  # the engine's steps (its own 4-row packer) grow the block tables (4-token blocks)
        engine.step()
    assert any(len(s.block_table) > len(t) for s, t in zip(seqs, tables))
    check(seqs)
    old = seqs[0]
    slot = old.slot
    engine.abort(old.request_id)
    new = engine.add_request(prompts6()[0], SamplingParams(temperature=0.9, top_p=0.5, top_k=2, max_tokens=50,
                                                           seed=11))
    while new.num_output == 0:
        engine.step()
    assert new.slot == slot  # the same slots in the same rows: only the claim tells the rows apart
    seqs = [new] + seqs[1:]
    check(seqs)
    assert len({s.slot for s in seqs}) == 4
    for s in seqs:
        engine.abort(s.request_id)
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))
    assert all(s.slot == -1 for s in seqs)


def test_step_packer_sends_the_filled_buffer_with_and_without_staging():
    """What the device views hold after send() is what the runner filled, through the staging copy (CUDA's path:
    `staging` turns it on here without CUDA) and without it, send after send; a staged send copies the buffer
    (filling it again changes nothing on the device until the next send)."""
    import numpy as np
    from eyas.engine.runner import StepPacker
    g = np.random.default_rng(0)
    packers = [StepPacker(2, 3, 4, True, torch.device("cpu"), staging=st) for st in (False, True)]
    assert packers[0].stage is None and packers[1].stage is not None
    assert not np.shares_memory(packers[1].stage, packers[1].buf)
    for _ in range(3):
        fill = {k: g.integers(-5, 100, v.shape) for k, v in packers[0].np.items() if k not in ("temperature", "top_p")}
        floats = {k: g.random(2).astype(np.float32) for k in ("temperature", "top_p")}
        for pk in packers:
            for k, v in {**fill, **floats}.items():
                pk.np[k][...] = v
            pk.send()
        for name in ("root_tokens", "commit_slots", "catchup_tokens", "block_tables", "seeds", "temperature",
                     "top_p"):
            want = torch.from_numpy(np.asarray({**fill, **floats}[name]))
            for pk in packers:
                assert torch.equal(getattr(pk.inputs, name), want.to(getattr(pk.inputs, name).dtype)), name
    staged = packers[1]
    before = staged.inputs.root_tokens.clone()
    staged.np["root_tokens"][...] = 12345
    assert torch.equal(staged.inputs.root_tokens, before)
    staged.send()
    assert (staged.inputs.root_tokens == 12345).all()


def test_slots_across_preemption_and_abort(mirror_pair):
    """Running sequences own distinct slots, others none; preemption and abort give them back; a re-admitted
    sequence continues exactly (greedy speculative output equals plain decoding), and no block or slot leaks."""
    target, draft = mirror_pair
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = plain(target, prompts6(), params)
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation="chain:4", num_blocks=24,
              block_size=4, max_num_seqs=4)
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts6()]
    victim = engine.add_request(prompts6()[2], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        running = engine.scheduler.running
        assert len({s.slot for s in running}) == len(running)
        assert all(0 <= s.slot < 4 for s in running)
        assert all(s.slot == -1 for s in engine.scheduler.waiting)
        if steps == 6 and not victim.finished:
            assert engine.abort(victim.request_id)
            assert victim.slot == -1
    assert [s.output_ids for s in seqs] == ref
    assert engine.scheduler.num_preemptions > 0
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2, 3]
    assert engine.blocks.num_used == 0


# ---- the tree dispatcher ------------------------------------------------------------------------------------------

DISPATCH = "dispatch:1=tree:mc_sim_7b_63,2=chain:4,4=tree:8,64=plain"


def test_dispatch_picks_the_tree_by_batch_size():
    from eyas.spec.dispatch import TreeDispatch
    from eyas.spec.tree import resolve_tree
    d = resolve_tree(DISPATCH)
    assert isinstance(d, TreeDispatch)
    assert [d.tree_for(n).name for n in (1, 2, 3, 4, 5, 64, 300)] == [
        "tree:mc_sim_7b_63", "chain:4", "tree:8", "tree:8", "chain:0", "chain:0", "chain:0"]
    assert d.max_depth == 5  # mc_sim's: the KV reservation and the catch-up window follow the deepest tree
    for bad in ["dispatch:", "dispatch:4=chain:3,2=tree:8", "dispatch:0=chain:3", "dispatch:x=chain:3",
                "dispatch:1=tree:nope", "dispatch:1=plain,4=plain", "dispatch:1=dispatch:1=chain:2",
                "dispatch:chain:3"]:
        with pytest.raises(ValueError):
            resolve_tree(bad)


BANDS = "dispatch:2=tree:8,64=chain:2|0.5=chain:5|0.9=dispatch:1=chain:1,4=plain"


def test_temperature_bands_pick_the_tree():
    """`SPEC|T=SPEC...`: a step whose hottest request has temperature t takes the last band with T <= t (greedy
    steps and t < the first T: the first SPEC); the KV reservation follows the deepest tree of any band."""
    from eyas.spec.tree import resolve_tree
    d = resolve_tree(BANDS)
    picks = {(n, t): d.tree_for(n, t).name for n in (1, 3, 8) for t in (0.0, 0.49, 0.5, 0.89, 0.9, 2.0)}
    assert picks == {
        (1, 0.0): "tree:8", (3, 0.0): "chain:2", (8, 0.0): "chain:2",
        (1, 0.49): "tree:8", (3, 0.49): "chain:2", (8, 0.49): "chain:2",
        (1, 0.5): "chain:5", (3, 0.5): "chain:5", (8, 0.5): "chain:5",
        (1, 0.89): "chain:5", (3, 0.89): "chain:5", (8, 0.89): "chain:5",
        (1, 0.9): "chain:1", (3, 0.9): "chain:0", (8, 0.9): "chain:0",
        (1, 2.0): "chain:1", (3, 2.0): "chain:0", (8, 2.0): "chain:0"}
    assert d.max_depth == 5 and d.temperatures == [0.0, 0.5, 0.9] and d.name == BANDS
    assert resolve_tree("chain:3|1=plain").tree_for(1, 1.0).name == "chain:0"
    assert resolve_tree("plain|0.5=tree:8").tree_for(1, 0.7).name == "tree:8"
    for bad in ["chain:3|0.5", "chain:3|x=plain", "chain:3|0=plain", "chain:3|-1=plain",
                "chain:3|0.9=plain|0.5=chain:1",
                "chain:3|0.5=plain|0.5=chain:1", "plain|0.5=plain", "chain:3|0.5=tree:nope", "chain:3|nan=plain"]:
        with pytest.raises(ValueError):
            resolve_tree(bad)


def test_temperature_bands_switch_trees_and_greedy_requests_stay_exact(mirror_pair):
    """Greedy requests alone take the first band's trees; with a hot sampled request in the batch the step takes
    the hot band's (greedy rows then accepted by the sampler), and the greedy requests' output is still plain
    decoding's, token for token; the sampled requests finish."""
    target, draft = mirror_pair
    greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (10, 30, 45)]
    hot = [SamplingParams(max_tokens=m, temperature=1.0, seed=7, ignore_eos=True) for m in (20, 25, 60)]
    prompts = prompts6()
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(prompts[:3], greedy)]
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=BANDS)
    outs = llm.generate(prompts, greedy + hot)
    assert [o.token_ids for o in outs[:3]] == ref
    assert [len(o.token_ids) for o in outs[3:]] == [20, 25, 60]
    used = llm.engine.runner.tree_steps
    assert set(used) == {"chain:0", "chain:1"}, used  # the 0.9 band: plain, then chain:1 for the last request
    alone = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=BANDS)
    assert [o.token_ids for o in alone.generate(prompts[:3], greedy)] == ref
    assert set(alone.engine.runner.tree_steps) <= {"tree:8", "chain:2"}, alone.engine.runner.tree_steps


def test_bands_that_end_in_plain_decoding_know_where_they_start():
    """`plain_from`: the lowest band temperature from which every band, at every batch size, is plain (a request that
    hot never speculates, in any batch); None where some hotter band still drafts."""
    from eyas.spec.tree import resolve_tree
    assert resolve_tree("dispatch:2=tree:8,64=chain:2|0.5=chain:3|0.9=plain").plain_from == 0.9
    assert resolve_tree("chain:3|0.5=dispatch:2=plain,8=plain|0.9=plain").plain_from == 0.5
    assert resolve_tree("chain:1|0.5=plain|0.9=plain").plain_from == 0.5
    for spec in [BANDS, "chain:3|0.5=plain|0.9=chain:1", "dispatch:2=tree:8,64=plain", "chain:3|0.5=chain:1"]:
        assert resolve_tree(spec).plain_from is None, spec


HOT_PLAIN = "dispatch:2=tree:8,64=chain:2|0.5=chain:3|0.9=plain"


def test_requests_that_never_speculate_decode_without_the_draft(mirror_pair, monkeypatch):
    """Bands that end in plain decoding (at 0.9): steps of hot requests alone run the bare root without the draft
    ("plain": no catch-up), steps with a cooler request beside them read along ("chain:0"), and cooler requests
    that arrive after the hot ones' draftless steps still speculate, with long accepted paths. Every token is
    that of the same engine without the shortcut; the hot requests' are plain decoding's, and the greedy one's."""
    import eyas.spec.step as step
    target, draft = mirror_pair
    prompts = prompts6()
    hot = [SamplingParams(max_tokens=m, temperature=t, seed=s, ignore_eos=True) for m, t, s in
           ((16, 1.0, 1), (12, 0.9, 2))]
    late = [SamplingParams(max_tokens=40, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.6, seed=3, ignore_eos=True)]
    calls = []
    f = step.catch_up
    monkeypatch.setattr(step, "catch_up", lambda *a, **k: calls.append(1) or f(*a, **k))

    def run(shortcut: bool):
        llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=HOT_PLAIN)
        engine, runner = llm.engine, llm.engine.runner
        assert runner.bare_tree is not None and runner.plain_from == 0.9
        if not shortcut:
            runner.bare_tree = None
        calls.clear()
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[2:4], hot)]
        for _ in range(6):  # the hot pair alone
            engine.step()
        seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[4:6], late)]
        while engine.has_unfinished():
            engine.step()
        steps = dict(runner.tree_steps)
        assert len(calls) == sum(steps.values()) - steps.get("plain", 0)  # a draftless step reads nothing
        return [s.output_ids for s in seqs], steps, seqs

    toks, steps, seqs = run(True)
    assert steps.get("plain", 0) >= 5 and steps.get("chain:0", 0) >= 1 and steps.get("chain:3", 0) >= 1, steps
    assert [len(t) for t in toks] == [16, 12, 40, 40]
    assert min(s.stats.committed / s.stats.target_calls for s in seqs[2:]) > 1.5  # the late ones speculate
    off_toks, off_steps, _ = run(False)
    assert "plain" not in off_steps
    assert toks == off_toks
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(
        [prompts[2], prompts[3], prompts[4]], hot + late[:1])]
    assert toks[:3] == ref


@pytest.mark.parametrize("pair", ["random_pair", "mirror_pair"])
def test_dispatch_switches_trees_between_steps_and_stays_exact(request, pair):
    """Six requests with different lengths: the batch shrinks from 6 to 1, so the steps go plain (with the draft
    reading along), tree:8, chain:4, then mc_sim; greedy output still equals plain decoding."""
    target, draft = request.getfixturevalue(pair)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 10, 20, 35, 55, 80)]
    ref = [o.token_ids for o in LLM(str(target), device="cpu", dtype="float32").generate(prompts6(), params)]
    llm = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=DISPATCH)
    outs = llm.generate(prompts6(), params)
    assert [o.token_ids for o in outs] == ref
    used = llm.engine.runner.tree_steps
    assert set(used) == {"chain:0", "tree:8", "chain:4", "tree:mc_sim_7b_63"}, used
    if pair == "mirror_pair":  # the speculative steps after plain ones still accept long paths
        assert max(o.stats.committed / max(o.stats.target_calls, 1) for o in outs) > 2.0
    small = LLM(str(target), device="cpu", dtype="float32", draft=str(draft), speculation=DISPATCH,
                num_blocks=36, block_size=4)  # the longest request fits, all six together do not
    assert [o.token_ids for o in small.generate(prompts6(), params)] == ref
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.blocks.num_used == 0


def test_the_draft_chooses_the_default_speculation(tmp_path):
    """Without --speculation, a draft's config.json `eyas_speculation` picks the tree for the device type (a dispatch
    with trees fitted to it for the GPU), else chain:3; the choice survives a save and reload, and the shipped
    SmolLM2 draft asks for its fitted tree at batch 1 on the GPU and chain:3 on the CPU."""
    import json

    from eyas.config import ModelConfig
    from eyas.spec.dispatch import default_speculation
    tdir = write_tiny_llama(tmp_path / "t", vocab=32, hidden=32, heads=4, kv_heads=2, layers=2, seed=0)
    ddir = write_random_draft(tmp_path / "d", tdir)
    assert LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir)).engine.tree.name == "chain:3"
    cfg = json.loads((ddir / "config.json").read_text())
    cfg["eyas_speculation"] = {"cpu": "dispatch:1=tree:8,4=chain:2", "cuda": "tree:16"}
    (ddir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir))
    assert llm.engine.tree.name == "dispatch:1=tree:8,4=chain:2"
    assert default_speculation(llm.draft, "cuda") == "tree:16"
    assert ModelConfig.from_hf(llm.draft.config.to_hf()).speculation == cfg["eyas_speculation"]
    # an explicit speculation wins
    assert LLM(str(tdir), device="cpu", dtype="float32", draft=str(ddir), speculation="chain:1").engine.tree.name \
        == "chain:1"
    shipped = ModelConfig.from_hf(json.loads((Path(__file__).parents[1] / "eyas/drafts/smollm2/config.json")
                                             .read_text()))
    holder = type("D", (), {"config": shipped})
    assert default_speculation(holder, "cpu") == "chain:3"
    assert default_speculation(holder, "cuda").startswith("dispatch:")
    from eyas.spec.tree import resolve_tree
    shipped_dispatch = resolve_tree(default_speculation(holder, "cuda"))
    # its fitted tree up to 2 requests, a dynamic tree of 8 to 16, tree:8 to 32, chain:3 beyond (the batch sweeps of
    # sessions 21 and 29 on the H200)
    assert [shipped_dispatch.tree_for(b).name for b in (1, 2, 3, 16, 17, 32, 33, 512)] == [
        "tree:smollm2_48d5", "tree:smollm2_48d5", "dyn:k4d3n8", "dyn:k4d3n8", "tree:8", "tree:8", "chain:3", "chain:3"]
    # sampled steps (session 59, H100, MT-Bench): at temperature 0.7 the fitted tree still won at batch 1 and chain:3
    # was the best beyond; at 1 every speculative mode lost to plain decoding, so plain steps (the draft reading along)
    assert [shipped_dispatch.tree_for(b, 0.3).name for b in (1, 16)] == ["tree:smollm2_48d5", "dyn:k4d3n8"]
    assert [shipped_dispatch.tree_for(b, 0.7).name for b in (1, 2, 3, 16)] == [
        "tree:smollm2_48d5", "tree:smollm2_48d5", "chain:3", "chain:3"]
    assert {shipped_dispatch.tree_for(b, 1.0).name for b in (1, 16, 64)} == {"chain:0"}
