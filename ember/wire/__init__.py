"""Wire models: the model contract, tensors and the V2 / OpenAI request and response shapes."""
