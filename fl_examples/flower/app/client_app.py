"""ClientApp of the example: privkit's local solver on client ``partition-id``.

``train`` is plain (client-level DP needs nothing more: the server clips and adds the noise);
``train.output``, ``train.objective`` and ``train.rec`` are the same
training behind privkit's output-perturbation, objective-perturbation and DP-REC mods (the
server picks one with its ``privacy`` setting). Data, seed and model come from the run config.
"""

from fl_examples.flower import make_client_app
from privkit.flower import ObjectivePerturbationMod, OutputPerturbationMod, RecMod

app = make_client_app(train_actions={"output": [OutputPerturbationMod()],
                                     "objective": [ObjectivePerturbationMod()],
                                     "rec": [RecMod()]})
