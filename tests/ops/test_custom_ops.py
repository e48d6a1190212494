"""The device operations are torch.library ops: schemas declare what they write, opcheck accepts them
(schema, fake tensors, AOT dispatch), and torch.compile traces them with no graph break."""

import pytest
import torch

from gpubuf.ops import backend_table, history, prefix_tree, priorities, sequence, stacks
from gpubuf.replay.sampling.tree import PrefixSumTree

# every op registered in the gpubuf namespace
OPS = sorted(s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("gpubuf::"))
# each op's CPU implementation, called with the op's arguments without the dispatcher
CPU = {"history_append": history.append_twin, "history_gather_frames": history.gather_frames_twin,
       "history_pack_blocks": history.pack_blocks_twin, "tree_sample": prefix_tree.sample_twin,
       "tree_update": prefix_tree.update_twin, "tree_update_range": prefix_tree.update_range_twin,
       "sequence_gather": sequence.gather_cpu, "frame_stack": stacks.stack_cpu,
       "n_step_return": stacks.return_cpu, "priority_write": priorities.write_host}


def _tree(capacity: int, fanout: int = 4) -> PrefixSumTree:
    tree = PrefixSumTree(capacity, backend_table(torch.device("cpu"), "torch"), fanout=fanout)
    tree.update_range(0, torch.arange(1, capacity + 1, dtype=torch.float64))
    return tree


def _samples() -> dict:
    """Small, index-valued arguments for every op (CPU)."""
    t = _tree(37)
    storage = torch.arange(6 * 5, dtype=torch.int64).view(6, 5)  # (M*E, D), M = 3, E = 2
    meta = torch.tensor([[0, 1], [2, 1], [0, 0]])  # (env, newest slot, k) per row
    marks = torch.tensor([0, 0, 5, 0, 0, 0], dtype=torch.uint8)
    return {
        "history_append": ([storage.clone()], [torch.full((2, 5), -1, dtype=torch.int64)], torch.tensor([1, 4])),
        "history_gather_frames": ([storage], [torch.zeros(2, 2, 5, dtype=torch.int64)], meta, 2, 1, 3),
        "history_pack_blocks": (storage.float(), torch.zeros(2, 1, 5), meta, 2, 1, 3),
        "tree_sample": (t.tree, t.offsets, t.fanout, torch.rand(9, dtype=torch.float64),
                        torch.zeros(9, dtype=torch.int64)),
        "tree_update": (t.tree.clone(), t.offsets, t.fanout, torch.tensor([3, 30]), torch.tensor([0.5, 2.0],
                                                                                                  dtype=torch.float64)),
        "tree_update_range": (t.tree.clone(), t.offsets, t.fanout, 5, torch.ones(7, dtype=torch.float64)),
        "sequence_gather": ([storage, storage], [torch.zeros(4, 2, 5, dtype=torch.int64)] * 2, [0, 1],
                            torch.tensor([0, 3, 4, 5]), 2, 2, 3),
        # marks of (M*E,) rows: an episode ends after row 2 (step 1, env 0); 3 rows held from row 0
        "frame_stack": ([storage, storage], [torch.zeros(3, 1, 2, 5, dtype=torch.int64)] * 2, [0, 1],
                        torch.tensor([2, 4, 5]), marks, torch.tensor([0, 3]), 1, 2, 1, 2, 3),
        "n_step_return": (torch.tensor([0, 1, 3]), torch.arange(6.0), marks, torch.tensor([0, 3]),
                          torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.int64),
                          torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool),
                          torch.tensor([0.5], dtype=torch.float64), 2, 2, 3),
        # start 3 twice (its largest new priority is kept), start 35 of zero validity
        "priority_write": (torch.arange(37, dtype=torch.float32), [t.tree.clone()], [torch.arange(37) % 5 != 0],
                           t.offsets, t.fanout, torch.tensor([3, 30, 3, 35]),
                           torch.tensor([0.5, -2.0, 4.0, 1.0], dtype=torch.float64), 1e-6, 0.5, 1e30,
                           torch.ones(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)),
    }


def test_every_operation_is_a_registered_op_that_declares_what_it_writes():
    want = {"history_append": ["storages"], "history_gather_frames": ["outs"], "history_pack_blocks": ["out"],
            "tree_sample": ["out"], "tree_update": ["tree"], "tree_update_range": ["tree"],
            "sequence_gather": ["outs"], "frame_stack": ["outs"],
            "n_step_return": ["ret", "disc", "boot", "term", "cut"],
            "priority_write": ["priority", "trees", "box", "result"]}
    written = {}
    for name in OPS:
        op = getattr(torch.ops.gpubuf, name).default
        written[name] = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert not op._schema.returns, name
    assert written == want
    assert set(_samples()) == set(OPS) == set(CPU)


@pytest.mark.parametrize("name", OPS)
def test_opcheck_accepts_every_op(name):
    torch.library.opcheck(getattr(torch.ops.gpubuf, name).default, _samples()[name],
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("name", OPS)
def test_the_dispatcher_runs_the_twin_on_cpu(name):
    args = _samples()[name]
    via_op = [a.clone() if isinstance(a, torch.Tensor) else [x.clone() for x in a]
              if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a for a in args]
    direct = [a.clone() if isinstance(a, torch.Tensor) else [x.clone() for x in a]
              if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a for a in args]
    getattr(torch.ops.gpubuf, name).default(*via_op)
    CPU[name](*direct)
    for a, b in zip(via_op, direct, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_compiled_sampler_traces_the_ops_in_one_graph():
    """Descent + window gather inside ``torch.compile(fullgraph=True)``: no graph break, same result."""
    t = _tree(40)
    storage = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # value = index: M = 20 rows, E = 2

    def draw(u):
        starts = torch.empty(u.shape, dtype=torch.int64)
        torch.ops.gpubuf.tree_sample(t.tree, t.offsets, t.fanout, u, starts)
        out = torch.empty(u.shape[0], 2, 3)
        words = out.view(torch.int32).view(u.shape[0], 2, 3)
        torch.ops.gpubuf.sequence_gather([storage.view(torch.int32)], [words], [0], starts, 2, 2, 20)
        return starts, out * 2

    u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(draw, fullgraph=True, backend="aot_eager")
    (s1, o1), (s2, o2) = compiled(u), draw(u)
    assert torch.equal(s1, s2) and torch.equal(o1, o2)
    want = torch.empty(16, dtype=torch.int64)
    prefix_tree.sample_twin(t.tree, t.offsets, t.fanout, u, want)
    assert torch.equal(s1, want)
    rows = (want[:, None] + torch.tensor([0, 2])) % 40
    assert torch.equal(o1, storage[rows] * 2)


def _to(args, device):
    """Copies of ``args`` on ``device``; a tensor passed twice stays one tensor."""
    seen = {}

    def move(t):
        return seen.setdefault(id(t), t.to(device, copy=True))

    return [move(a) if isinstance(a, torch.Tensor) else [move(x) for x in a]
            if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a for a in args]


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPS)
def test_every_op_on_the_gpu_matches_its_twin_on_the_host(name):
    """The dispatcher runs the Triton kernel on CUDA tensors (here on the last GPU, not the current one when
    there are several): the same writes as the twin on host copies."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    args = _samples()[name]
    host, gpu = _to(args, "cpu"), _to(args, dev)
    getattr(torch.ops.gpubuf, name).default(*gpu)
    CPU[name](*host)
    torch.cuda.synchronize(dev)
    for a, b in zip(gpu, host, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.device == dev and torch.equal(a.cpu(), b), name
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(x.cpu(), y) for x, y in zip(a, b, strict=True)), name
