"""Example Flower app: Upcycled-FL / FedProx on privkit's synthetic data (``flwr run``)."""
