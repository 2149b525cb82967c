from reliable_consumer.cli import app

app()
