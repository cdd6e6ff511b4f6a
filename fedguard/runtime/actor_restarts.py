"""A simulated client whose process dies is started again, so that the federation keeps every client.

Flower's Ray backend (1.41, which the project pins) runs the simulated clients in ``ClientAppActor`` actors that
Ray creates with its default ``max_restarts=0``: an actor whose process dies (the OOM killer, a segfault,
``os._exit``) stays in the backend's pool dead, every later message sent to it fails, and the run goes on with
fewer clients to its end. ``restart_dead_clients`` has the backend create its actors from a class Ray restarts
(``max_restarts=-1``) and whose messages it tries once more on system failures (``max_task_retries=1``): the
message the dying actor held is run once more in the new process (a client that dies of it again fails that
round, and the server records its failure with the reason), and a message sent while the actor restarts waits
for it instead of failing. The new process loads the ClientApp again and the client's own state from the run
folder (``fedguard.store.client_state``). Measured (``tests/test_hostile_clients.py``, 3 clients, 6 rounds,
client 1's process ended in round 2): round 2 ran with 2 clients and named client 1's death, rounds 3-6 with 3.

``fedguard.runtime.client_app`` calls it on import: Flower's simulation engine loads the ClientApp in its own
process before it builds the backend (``flwr.server.superlink.fleet.vce.vce_api.start_vce``), in ``fedguard
run``'s simulation process and in the warm runner alike.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

SIMULATION = "flwr.simulation.run_simulation"  # imported by every process that runs Flower's simulation engine
ACTORS = "flwr.simulation.ray_transport.ray_actor"
BACKEND = "flwr.server.superlink.fleet.vce.backend.raybackend"


@functools.cache
def restarted_actor_class() -> Any:
    """Flower's ``ClientAppActor``, as a Ray actor class that Ray restarts whenever its process dies."""
    import ray
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

    @ray.remote(max_restarts=-1, max_task_retries=1)
    class RestartedClientAppActor(VirtualClientEngineActor):
        """Runs a client's messages, as Flower's ``ClientAppActor`` does; restarted by Ray when it dies."""

        def __init__(self, on_actor_init_fn: Any = None) -> None:
            super().__init__()
            if on_actor_init_fn:
                on_actor_init_fn()

    return RestartedClientAppActor


def restart_dead_clients() -> bool:
    """Have the Ray backend of this process's simulation engine create client actors that Ray restarts; returns
    whether it does (False, and nothing imported, in a process that runs no simulation engine: a SuperNode)."""
    if SIMULATION not in sys.modules:
        return False
    import importlib

    restarted = restarted_actor_class()
    for name in (ACTORS, BACKEND):  # the backend imports the class by name from the actors' module
        if name == ACTORS or name in sys.modules:
            module: Any = importlib.import_module(name)
            module.ClientAppActor = restarted
    return True
