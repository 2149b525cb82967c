from reliable_consumer.cli import main

main()
