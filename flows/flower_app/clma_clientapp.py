"""ClientApp of a CLMA federation on real clients: the CLMA ClientApp (clma.flower.clientapp)
over the model the server names in the run config (model-spec) and the data the SuperNode
names in its node config (data-source='package.module:function'; the built-in demo is
clma.sim.demo:simulated_shard). A ClientApp of your own:
make_client_app(lambda context: TorchLearner(...))."""

from clma.flower.clientapp import make_client_app

app = make_client_app()
