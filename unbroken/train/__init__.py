"""What a training loop touches: the step protocol and the model/optimizer wrappers."""
