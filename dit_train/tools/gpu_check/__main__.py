import sys

from dit_train.tools.gpu_check import main

sys.exit(main(sys.argv[1:]))
