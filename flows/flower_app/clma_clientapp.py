"""ClientApp of a CLMA federation on real clients: the CLMA ClientApp with the digits
learner of the node's partition id (clma.flower.clientapp). Point it at your own model and
data by changing the factory: make_client_app(lambda context: TorchLearner(...))."""

from clma.flower.clientapp import make_client_app

app = make_client_app()
