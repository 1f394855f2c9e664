-- Second database for the MLflow backend store (the first, "prefect", is POSTGRES_DB).
CREATE DATABASE mlflow OWNER clma;
