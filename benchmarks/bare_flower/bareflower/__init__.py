"""A bare Flower app: FedSGD as one local SGD step per client, averaged by Flower's FedAvg."""
