"""The v3 kernels' synchronisation, as models run under random interleavings.

Gluon kernels do not run on a CPU, and a wrong mbarrier parity or a missing wait shows on a GPU as a hang
or as wrong numbers only under some timings. These tests check the protocols themselves: each partition
of a kernel is a sequence of the operations it performs on its barriers and buffers, with the parities the
kernel computes (the same expressions), and a scheduler runs the partitions in random orders. Checked:
no interleaving deadlocks; every read of a shared buffer sees the step it expects (a buffer is never
overwritten before its readers are done); the forward's softmaxes, or in its ping-pong schedule its
products, come in turn order; the ORDERED
backward's additions into each dQ tile come in key-block order, with any number of programs resident.

mbarrier semantics: a barrier of count n completes a phase at its n-th arrival; waiting for parity p
returns once the phase with that parity is complete, which on a fresh barrier holds for p = 1.
"""
import random

import pytest

STAGES = 2  # the rings of kernels/v3/fmha_fwd.py and fmha_bwd.py
SEED = 2026


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1

    def passes(self, parity):
        return self.completed & 1 != parity


class Machine:
    """Partitions (generators of operations) over shared barriers, buffers and global counters."""

    def __init__(self, rng):
        self.rng, self.barriers, self.buffers, self.counters, self.log = rng, {}, {}, {}, []
        self.current = {}

    def add(self, name, partition):
        """Makes the partition's next operation current; a finished partition leaves."""
        try:
            self.current[name] = next(partition), partition
        except StopIteration:
            self.current.pop(name, None)

    def _runnable(self, op):
        if op[0] == "wait":
            return self.barriers[op[1]].passes(op[2])
        if op[0] == "spin":  # a global counter must equal a value
            return self.counters.get(op[1], 0) == op[2]
        return True

    def step(self):
        """Runs one operation of a random runnable partition; False once every partition has finished."""
        if not self.current:
            return False
        runnable = [name for name, (op, _) in self.current.items() if self._runnable(op)]
        if not runnable:
            raise AssertionError(f"deadlock: {[op for op, _ in self.current.values()]}")
        name = self.rng.choice(runnable)
        op, partition = self.current[name]
        kind = op[0]
        if kind == "arrive":
            self.barriers[op[1]].arrive()
        elif kind == "write":
            self.buffers[op[1]] = op[2]
        elif kind == "read":
            assert self.buffers.get(op[1]) == op[2], f"{name} reads {op[1]} of step {self.buffers.get(op[1])}, not {op[2]}"
        elif kind == "release":
            self.counters[op[1]] = self.counters.get(op[1], 0) + 1
        elif kind == "log":
            self.log.append(op[1])
        self.add(name, partition)
        return True


# ------------------------------------------------------------------------ forward (kernels/v3/fmha_fwd.py)


def _wait_turn(c, k):
    """Consumer c's k-th turn (_wait_turn): passed on by the previous consumer's k-th, or to consumer 0 by the
    last consumer's (k-1)-th."""
    return ("wait", "turn0", (k & 1) ^ 1) if c == 0 else ("wait", f"turn{c}", k & 1)


def _forward_barriers(m, consumers, tiles):
    """The barriers of the forward and its two loader partitions, shared by every schedule: `tiles` holds the
    key blocks of each of the program's tiles (TILES: one or two). One loader copies each tile's Q tiles,
    once their consumers have given the buffers back (`q_free`), then V's ring; the other K's ring. The
    ring runs on through the tiles."""
    m.barriers.update({f"{name}{i}": Barrier(1) for name in ("k_ready", "v_ready") for i in range(STAGES)})
    m.barriers.update({f"{name}{i}": Barrier(consumers) for name in ("k_empty", "v_empty") for i in range(STAGES)})
    m.barriers.update({f"turn{c}": Barrier(1) for c in range(consumers)})
    m.barriers.update({f"{name}{c}": Barrier(1) for name in ("q_ready", "q_free") for c in range(consumers)})

    def loader(kv):
        r = 0
        for i, n_blocks in enumerate(tiles):
            if kv == "v":
                for c in range(consumers):
                    yield from (("wait", f"q_free{c}", (i & 1) ^ 1), ("write", f"Q{c}", i), ("arrive", f"q_ready{c}"))
            for t in range(r, r + n_blocks):
                stage, free = t % STAGES, ((t // STAGES) & 1) ^ 1
                yield ("wait", f"{kv}_empty{stage}", free)
                yield ("write", f"{kv.upper()}{stage}", t)
                yield ("arrive", f"{kv}_ready{stage}")
            r += n_blocks

    m.add("k_loader", loader("k"))
    m.add("v_loader", loader("v"))


def _forward(m, consumers, n_blocks, turns):
    _forward_barriers(m, consumers, [n_blocks])

    def softmax(c, t):
        if turns:
            yield _wait_turn(c, t)
        yield ("log", (t, c))
        if turns:
            yield ("arrive", f"turn{(c + 1) % consumers}")

    def consumer(c):
        yield from (("wait", f"q_ready{c}", 0), ("read", f"Q{c}", 0))
        if n_blocks == 0:
            return
        yield from (("wait", "k_ready0", 0), ("read", "K0", 0), ("arrive", "k_empty0"))
        for t in range(n_blocks - 1):
            stage, nxt = t % STAGES, (t + 1) % STAGES
            yield from (("wait", f"k_ready{nxt}", ((t + 1) // STAGES) & 1), ("read", f"K{nxt}", t + 1))
            yield from softmax(c, t)
            yield from (("wait", f"v_ready{stage}", (t // STAGES) & 1), ("read", f"V{stage}", t),
                        ("arrive", f"v_empty{stage}"), ("arrive", f"k_empty{nxt}"))
        last = n_blocks - 1
        yield from softmax(c, last)
        yield from (("wait", f"v_ready{last % STAGES}", (last // STAGES) & 1), ("read", f"V{last % STAGES}", last),
                    ("arrive", f"v_empty{last % STAGES}"))

    for c in range(consumers):
        m.add(f"consumer{c}", consumer(c))


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("turns", [False, True], ids=["free", "turns"])
def test_the_forward_never_deadlocks_and_takes_its_softmaxes_in_turn(consumers, turns):
    rng = random.Random(SEED)
    for n_blocks in range(7):
        for _ in range(300):
            m = Machine(rng)
            _forward(m, consumers, n_blocks, turns)
            while m.step():
                pass
            if turns:
                assert m.log == [(t, c) for t in range(n_blocks) for c in range(consumers)]


def _pingpong_forward(m, consumers, tiles, own_o=False):
    """The PINGPONG schedule (_pingpong_blocks) through the program's tiles (`tiles`: each one's key blocks):
    every product issued in the consumer's turn, a tile's S_0 in its first turn, S_{t+1} and P_t V_t in the
    next, its last P V in the one after; the ring's blocks and the turns run on from tile to tile, and a
    tile without key blocks takes neither. A product reads its K or V buffer from its issue to its wait,
    after which the buffer is released; the consumer reads its Q tile with each S product and gives it back
    (`q_free`) after its O has gone out through it, or, with `own_o` (OWN_O: O has a buffer of its own),
    once its last S product is done."""
    _forward_barriers(m, consumers, tiles)

    def in_turn(c, k, products):
        yield _wait_turn(c, k)
        for name, t in products:
            buffer, ready = (f"K{t % STAGES}", "k_ready") if name == "S" else (f"V{t % STAGES}", "v_ready")
            yield from (("wait", f"{ready}{t % STAGES}", (t // STAGES) & 1), ("read", buffer, t), ("log", (name, t, c)))
        yield ("arrive", f"turn{(c + 1) % consumers}")

    def done(kv, t):  # the product's wait, then the release of its buffer
        yield from (("read", f"{kv.upper()}{t % STAGES}", t), ("arrive", f"{kv}_empty{t % STAGES}"))

    def consumer(c):
        r0 = k0 = 0
        for i, n_blocks in enumerate(tiles):
            yield from (("wait", f"q_ready{c}", i & 1), ("read", f"Q{c}", i))
            if own_o and not n_blocks:
                yield ("arrive", f"q_free{c}")
            if n_blocks:
                yield from in_turn(c, k0, [("S", r0)])
                yield from done("k", r0)
                for t in range(n_blocks - 1):
                    r = r0 + t
                    yield from in_turn(c, k0 + t + 1, [("S", r + 1), ("PV", r)])
                    yield from (("read", f"Q{c}", i), *done("k", r + 1))  # warpgroup_mma_wait(1): S_{t+1}, its softmax
                    yield from done("v", r)  # warpgroup_mma_wait(0): P_t V_t
                if own_o:  # the last S product is done: Q is read no more
                    yield ("arrive", f"q_free{c}")
                yield from in_turn(c, k0 + n_blocks, [("PV", r0 + n_blocks - 1)])
                yield from done("v", r0 + n_blocks - 1)
                r0, k0 = r0 + n_blocks, k0 + n_blocks + 1
            if own_o:
                yield ("write", f"O{c}", i)
            else:
                yield from (("read", f"Q{c}", i), ("write", f"Q{c}", ("O", i)), ("arrive", f"q_free{c}"))  # O out through Q

    for c in range(consumers):
        m.add(f"consumer{c}", consumer(c))


def _pingpong_products(consumers, tiles):
    """The products in the order the turns give them: tile by tile, turn by turn, consumer by consumer."""
    out, r0 = [], 0
    for n_blocks in tiles:
        if n_blocks:
            turns = [[("S", r0)]] + [[("S", r0 + t + 1), ("PV", r0 + t)] for t in range(n_blocks - 1)]
            turns += [[("PV", r0 + n_blocks - 1)]]
            out += [(name, t, c) for products in turns for c in range(consumers) for name, t in products]
        r0 += n_blocks
    return out


@pytest.mark.parametrize("consumers", [2, 3])
def test_the_pingpong_forward_never_deadlocks_and_issues_its_products_in_turn(consumers):
    rng = random.Random(SEED)
    for n_blocks in range(7):
        for _ in range(300):
            m = Machine(rng)
            _pingpong_forward(m, consumers, [n_blocks])
            while m.step():
                pass
            assert m.log == _pingpong_products(consumers, [n_blocks])


@pytest.mark.parametrize("own_o", [False, True], ids=["O through Q", "O of its own"])
@pytest.mark.parametrize("consumers", [2, 3])
def test_several_tiles_a_program_run_on_through_the_ring_and_the_turns(consumers, own_o):
    """TILES = 2 (kernels/v3/fmha_fwd.py): a heavy and a light tile under a causal mask, tiles without key
    blocks (a window that leaves a tile's rows no key) and odd counts that end a tile mid-ring; TILES = 4 (runs
    of query blocks without a mask: alike tiles, a run cut short at the sequence's end); a tile's Q never lands
    before the tile before it has let its buffer go (a read of Q, or of O where O leaves through Q, would see it)."""
    rng = random.Random(SEED)
    for tiles in ([3, 1], [4, 4], [1, 0], [0, 2], [0, 0], [5, 2], [2, 3], [3, 3, 3, 3], [2, 2, 2], [1, 1, 1, 1],
                  [4, 4, 4, 1]):
        for _ in range(300):
            m = Machine(rng)
            _pingpong_forward(m, consumers, tiles, own_o)
            while m.step():
                pass
            assert m.log == _pingpong_products(consumers, tiles)


# ------------------------------------------------------------------ wide backward (kernels/v3/fmha_bwd_wide.py)


def _wide_backward(m, n_steps, p="p0", tiles=None):
    """Program p of the wide kernel; with `tiles` ([(tile, rank)] a step) its ORDERED form."""
    b = {"kv_ready": Barrier(1), "p_full": Barrier(1), "p_empty": Barrier(2), "ds_full": Barrier(1),
         "ds_empty": Barrier(2), "dq_done": Barrier(2)}
    b |= {f"q_ready{i}": Barrier(1) for i in range(STAGES)} | {f"q_empty{i}": Barrier(2) for i in range(STAGES)}
    m.barriers.update({f"{p}.{name}": barrier for name, barrier in b.items()})

    def loader():
        yield from (("write", f"{p}.K", "k"), ("arrive", f"{p}.kv_ready"))
        for t in range(n_steps):
            stage = t % STAGES
            yield from (("wait", f"{p}.q_empty{stage}", ((t // STAGES) & 1) ^ 1), ("write", f"{p}.Q{stage}", t),
                        ("arrive", f"{p}.q_ready{stage}"))

    def complete_and_release(c, counter, step):
        yield ("arrive", f"{p}.dq_done")
        if c == 0:
            yield from (("wait", f"{p}.dq_done", step & 1), ("release", counter))

    def consumer(c):
        yield ("wait", f"{p}.kv_ready", 0)
        previous = None
        for t in range(n_steps):
            stage = t % STAGES
            yield from (("wait", f"{p}.q_ready{stage}", (t // STAGES) & 1), ("read", f"{p}.Q{stage}", t))
            if c == 0:  # S, P
                yield from (("read", f"{p}.K", "k"), ("wait", f"{p}.p_empty", (t & 1) ^ 1), ("write", f"{p}.P", t),
                            ("arrive", f"{p}.p_full"), ("wait", f"{p}.ds_full", t & 1))
            else:  # dP, dS from P
                yield from (("wait", f"{p}.p_full", t & 1), ("read", f"{p}.P", t), ("wait", f"{p}.ds_empty", (t & 1) ^ 1),
                            ("write", f"{p}.dS", t), ("arrive", f"{p}.ds_full"))
            yield from (("read", f"{p}.P", t), ("read", f"{p}.dS", t), ("read", f"{p}.Q{stage}", t),  # dV and dK
                        ("arrive", f"{p}.p_empty"), ("arrive", f"{p}.q_empty{stage}"))
            if tiles is not None:
                yield ("spin", *tiles[t])
            yield from (("read", f"{p}.dS", t), ("read", f"{p}.K", "k"))  # dQ
            if tiles is not None:
                yield ("log", (tiles[t][0], p, c))
                if t > 0:
                    yield from complete_and_release(c, previous, t - 1)
                previous = tiles[t][0]
            yield ("arrive", f"{p}.ds_empty")
        if n_steps:
            if tiles is not None:
                yield from complete_and_release(c, previous, n_steps - 1)
            yield ("wait", f"{p}.ds_empty", (n_steps - 1) & 1)
        yield ("write", f"{p}.K", f"dK{c}")  # dK leaves through K's memory

    m.add(f"{p}.loader", loader())
    for c in range(2):
        m.add(f"{p}.consumer{c}", consumer(c))


def test_the_wide_backward_never_deadlocks_nor_overwrites_a_buffer_being_read():
    rng = random.Random(SEED)
    for n_steps in range(8):
        for _ in range(300):
            m = Machine(rng)
            _wide_backward(m, n_steps)
            while m.step():
                pass


# ----------------------------------------------------------- ORDERED backward (kernels/v3/fmha_bwd.py)


def _paired_backward(m, tiles):
    """The atomic dK/dV program of the 64 and 128 tiles (kernels/v3/fmha_bwd.py) through its key blocks
    (`tiles`: each block's steps; TILES = 2 gives a program two). One loader copies K then the steps' Q tiles,
    the other V then dO, through a ring that runs on from block to block; each key block's K and V wait
    until both consumers have given the buffers back (`kv_free`: their dK and dV left through them). A
    consumer's step reads its half of K and V, both halves of dS, and all of K for its dQ product; its dK
    and dV go into its halves of K's and V's memory once the other consumer's last dQ product is done."""
    b = {f"{name}{i}": Barrier(2) for name in ("q_ready", "q_empty") for i in range(STAGES)}
    b |= {f"{name}{i}": Barrier(2) for name in ("ds_full", "ds_empty") for i in range(2)}
    m.barriers.update(b | {"kv_ready": Barrier(2), "kv_free": Barrier(2)})

    def loader(kv, qo):
        r = 0
        for i, n_steps in enumerate(tiles):
            yield from (("wait", "kv_free", (i & 1) ^ 1), ("write", f"{kv}.0", i), ("write", f"{kv}.1", i),
                        ("arrive", "kv_ready"))
            for t in range(r, r + n_steps):
                stage = t % STAGES
                yield from (("wait", f"q_empty{stage}", ((t // STAGES) & 1) ^ 1), ("write", f"{qo}{stage}", t),
                            ("arrive", f"q_ready{stage}"))
            r += n_steps

    def consumer(c):
        r = 0
        for i, n_steps in enumerate(tiles):
            yield ("wait", "kv_ready", i & 1)
            for t in range(r, r + n_steps):
                stage, buf = t % STAGES, t % 2
                yield from (("wait", f"q_ready{stage}", (t // STAGES) & 1), ("read", f"Q{stage}", t),
                            ("read", f"dO{stage}", t), ("read", f"K.{c}", i), ("read", f"V.{c}", i),
                            ("wait", f"ds_empty{buf}", ((t // 2) & 1) ^ 1), ("write", f"dS{buf}.{c}", t),
                            ("arrive", f"ds_full{buf}"), ("wait", f"ds_full{buf}", (t // 2) & 1),
                            ("read", f"dS{buf}.0", t), ("read", f"dS{buf}.1", t), ("read", "K.0", i), ("read", "K.1", i),
                            ("arrive", f"ds_empty{buf}"), ("arrive", f"q_empty{stage}"))
            if n_steps:
                last = r + n_steps - 1
                yield ("wait", f"ds_empty{last % 2}", (last // 2) & 1)
            yield from (("write", f"K.{c}", ("dK", i)), ("write", f"V.{c}", ("dV", i)), ("log", ("dK dV", i, c)),
                        ("arrive", "kv_free"))
            r += n_steps

    for name, partition in (("k_loader", loader("K", "Q")), ("v_loader", loader("V", "dO")), ("consumer0", consumer(0)),
                            ("consumer1", consumer(1))):
        m.add(name, partition)


def test_the_atomic_backward_runs_two_key_blocks_a_program_through_one_ring():
    """TILES = 2: a heavy and a light key block under a causal mask, blocks no query sees, odd step counts
    that end a block mid-ring; no loader overwrites K or V while a consumer still reads them (a read would
    see the next block's), and no consumer's dK overwrites K before the other's last dQ product is done."""
    rng = random.Random(SEED)
    for tiles in ([3, 1], [2, 2], [0, 3], [4, 0], [1, 1], [5, 3], [2]):
        for _ in range(300):
            m = Machine(rng)
            _paired_backward(m, tiles)
            while m.step():
                pass
            assert sorted(m.log) == sorted(("dK dV", i, c) for i in range(len(tiles)) for c in range(2))


def _ordered_program(m, p, tiles):
    """Program p (its ticket: key block p of one head) over its steps' dQ tiles [(tile, rank)]."""
    n = len(tiles)
    b = {f"q_ready{i}": Barrier(1) for i in range(STAGES)} | {f"q_empty{i}": Barrier(2) for i in range(STAGES)}
    b |= {f"ds_full{i}": Barrier(2) for i in range(2)} | {f"ds_empty{i}": Barrier(2) for i in range(2)}
    b |= {"dq_full": Barrier(2), "dq_empty": Barrier(1)}
    m.barriers.update({f"p{p}.{name}": barrier for name, barrier in b.items()})

    def loader():
        for t in range(n):
            stage = t % STAGES
            yield from (("wait", f"p{p}.q_empty{stage}", ((t // STAGES) & 1) ^ 1), ("write", f"p{p}.Q{stage}", t),
                        ("arrive", f"p{p}.q_ready{stage}"))

    def consumer(c):
        for t in range(n):
            stage, buf = t % STAGES, t % 2
            yield from (("wait", f"p{p}.q_ready{stage}", (t // STAGES) & 1), ("read", f"p{p}.Q{stage}", t),
                        ("wait", f"p{p}.ds_empty{buf}", ((t // 2) & 1) ^ 1), ("write", f"p{p}.dS{buf}.{c}", t),
                        ("arrive", f"p{p}.ds_full{buf}"), ("wait", f"p{p}.ds_full{buf}", (t // 2) & 1),
                        ("read", f"p{p}.dS{buf}.0", t), ("read", f"p{p}.dS{buf}.1", t),
                        ("arrive", f"p{p}.ds_empty{buf}"), ("arrive", f"p{p}.q_empty{stage}"),
                        ("wait", f"p{p}.dq_empty", (t & 1) ^ 1), ("write", f"p{p}.dq{c}", t),
                        ("arrive", f"p{p}.dq_full"))

    def writer():
        previous = None
        for t, (tile, rank) in enumerate(tiles):
            yield from (("spin", tile, rank), ("wait", f"p{p}.dq_full", t & 1), ("read", f"p{p}.dq0", t),
                        ("read", f"p{p}.dq1", t), ("log", (tile, p)), ("arrive", f"p{p}.dq_empty"))
            if previous is not None:  # the previous tile's additions are complete: count this key block in
                yield ("release", previous)
            previous = tile
        if previous is not None:
            yield ("release", previous)

    for name, partition in (("loader", loader()), ("consumer0", consumer(0)), ("consumer1", consumer(1)),
                            ("writer", writer())):
        m.add(f"p{p}.{name}", partition)


def _run_ordered(rng, causal, program, descending):
    """Programs start in ticket order (a head's key blocks in increasing order), at most `resident` at once, a
    new one when one ends, each walking its query blocks up or (descending, as the v3 ORDERED form does:
    common.query_step) down; returns the programs, in order, that added into each dQ tile."""
    key_blocks, query_blocks, resident = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6)
    m = Machine(rng)
    visits = {kb: sorted((q for q in range(query_blocks) if not causal or q >= kb), reverse=descending)
              for kb in range(key_blocks)}
    started = 0
    while True:
        while started < key_blocks and len({name.split(".")[0] for name in m.current}) < resident:
            program(m, started, [(q, sum(1 for k in range(started) if q in visits[k])) for q in visits[started]])
            started += 1
        if not m.step() and started == key_blocks:
            break
    assert sorted({entry[0] for entry in m.log}) == sorted({q for qs in visits.values() for q in qs})
    return m.log


@pytest.mark.parametrize("descending", [False, True], ids=["walking up", "walking down"])
@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
def test_the_ordered_backward_adds_in_key_block_order_with_any_number_of_programs_resident(causal, descending):
    """The smallest unfinished ticket never waits for a later one, so every run finishes, and each tile's
    additions come in key-block order, whichever way the programs walk their query blocks."""
    rng = random.Random(SEED)
    for _ in range(400):
        by_tile = {}
        for tile, p in _run_ordered(rng, causal, _ordered_program, descending):
            by_tile.setdefault(tile, []).append(p)
        assert all(programs == sorted(programs) for programs in by_tile.values()), by_tile


@pytest.mark.parametrize("descending", [False, True], ids=["walking up", "walking down"])
@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
def test_the_wide_ordered_backward_adds_in_key_block_order(causal, descending):
    """The wide kernel's ORDERED form: both consumers add their quarters of a tile after its counter reached
    the key block's rank; consumer 0 counts the key block in once both consumers' additions are complete."""
    rng = random.Random(SEED)
    for _ in range(400):
        log = _run_ordered(rng, causal, lambda m, p, tiles: _wide_backward(m, len(tiles), f"p{p}", tiles), descending)
        by_tile = {}
        for tile, p, _consumer in log:
            by_tile.setdefault(tile, []).append(int(p[1:]))
        assert all(programs == sorted(programs) for programs in by_tile.values()), by_tile
