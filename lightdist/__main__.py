from lightdist.cli import main

main()
