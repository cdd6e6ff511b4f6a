"""A Flower ``Grid`` that delivers messages to ClientApps in this process: strategies tested end to end
without a SuperLink."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid


class LocalGrid(Grid):
    """``num_nodes`` SuperNodes (node ids 100, 101, ...) with partitions ``0..num_nodes-1``, each running
    ``client_app``; ``fail`` holds partitions whose ClientApp raises. Replies keep node order."""

    def __init__(self, client_app: ClientApp, num_nodes: int, num_partitions: int | None = None,
                 fail: Iterable[int] = ()) -> None:
        self.client_app = client_app
        self.fail = set(fail)
        self.contexts = {
            100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config={},
                             node_config={"partition-id": i, "num-partitions": num_partitions or num_nodes})
            for i in range(num_nodes)
        }
        self.sent: list[Message] = []

    def set_run(self, run) -> None:  # noqa: ANN001 - not used in process
        raise NotImplementedError

    @property
    def run(self):  # noqa: ANN201
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:  # noqa: ANN001
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.sent.append(message)
            context = self.contexts[message.metadata.dst_node_id]
            try:
                if context.node_config["partition-id"] in self.fail:
                    raise RuntimeError("this client fails")
                reply = self.client_app(message, context)
            except Exception as error:  # what a SuperNode reports for a failing ClientApp
                reply = Message(Error(code=0, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            reply.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
            replies.append(reply)
        return replies
