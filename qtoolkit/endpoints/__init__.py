"""Endpoints: any OpenAI-compatible server as a deployment to evaluate, benchmark and sign off."""
