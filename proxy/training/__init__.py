"""Training seen from the proxy: jobs from ready groups, and publishing what the trainer made."""

from proxy.training._publisher import Publisher, PublishError
from proxy.training._scheduler import JobScheduler

__all__ = ["JobScheduler", "PublishError", "Publisher"]
