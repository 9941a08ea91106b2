from ddplab.cli.main import console

console()
