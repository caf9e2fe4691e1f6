"""Training seen from the proxy: jobs from ready groups, publishing what the trainer made, canary trials of
new versions (``--canary``), the regression guard, and handing a shared GPU over to the trainer for each step
(``--share-gpu``)."""

from proxy.training._canary import Canary
from proxy.training._canary_verdict import CanaryConfig
from proxy.training._handover import HandoverCoordinator
from proxy.training._loading import PublishError
from proxy.training._publisher import Publisher
from proxy.training._scheduler import JobScheduler

__all__ = ["Canary", "CanaryConfig", "HandoverCoordinator", "JobScheduler", "PublishError", "Publisher"]
