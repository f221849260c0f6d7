"""kvbm's integrations with vLLM: ``kvbm.vllm_integration.connector.DynamoConnector``."""
