"""``FreeQueue`` (the allocators' free list) behaves as a ``deque`` of ints under every operation the
allocators and the tests use, across wrap-around and growth; ``sorted_unique`` is ``np.unique``."""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from refcache.gpu.allocator import FreeQueue, sorted_unique


def test_free_queue_matches_a_deque() -> None:
    rng = random.Random(17)
    for _ in range(200):
        queue, model = FreeQueue(range(rng.randrange(40))), deque(range(0))
        model.extend(queue)
        for _ in range(60):
            op = rng.randrange(6)
            if op == 0:
                n = rng.randrange(len(model) + 1)
                assert queue.take(n).tolist() == [model.popleft() for _ in range(n)]
            elif op == 1:
                numbers = [rng.randrange(100) for _ in range(rng.randrange(30))]
                queue.put(np.array(numbers, dtype=np.int64))
                model.extend(numbers)
            elif op == 2:
                number = rng.randrange(100)
                queue.appendleft(number)
                model.appendleft(number)
            elif op == 3:
                numbers = [rng.randrange(100) for _ in range(rng.randrange(5))]
                queue.extendleft(numbers)
                model.extendleft(numbers)
            elif op == 4 and model:
                assert queue.popleft() == model.popleft()
            else:
                number = rng.randrange(100)
                queue.append(number)
                model.append(number)
            assert list(queue) == list(model) and len(queue) == len(model)
            n = rng.randrange(len(model) + 1)
            assert queue.peek(n).tolist() == list(model)[:n]


def test_sorted_unique_is_np_unique() -> None:
    rng = random.Random(5)
    for _ in range(200):
        numbers = np.array([rng.randrange(20) for _ in range(rng.randrange(12))], dtype=np.int64)
        assert sorted_unique(numbers).tolist() == np.unique(numbers).tolist()
