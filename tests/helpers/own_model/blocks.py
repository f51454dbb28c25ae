import torch


class ConvBlock(torch.nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(
            torch.nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
            torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(inplace=True),
        )
