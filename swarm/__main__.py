from swarm.cli import main

main()
