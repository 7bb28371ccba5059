"""Reward models behind one protocol, a registry, weighted combination, remote and async scoring.

    from rewards import build_reward
    reward = build_reward({"ocr": 1.0, "pickscore": 0.5}, device="cuda:1")
    scores = reward(images, prompts, metadata)   # images: float (B, 3, H, W) in [0, 1]
    # -> {"ocr": Tensor(B,), "pickscore": Tensor(B,), "total": Tensor(B,)}, float32 on the CPU
    scores = reward(videos, prompts, metadata)   # videos: (B, F, 3, H, W): image rewards score them by frames

Heavy modules (open_clip, transformers, rapidocr) are imported when a reward is built, not here.
"""

from . import brightness, clip_models, jpeg, ocr, remote, shapes  # noqa: F401  (register the built-in rewards)
from .async_ import AsyncReward
from .base import BaseReward, ModelReward, Reward, RewardError, check_inputs
from .brightness import Brightness
from .clip_models import Aesthetic, AestheticMLP, ClipScore, HPSv2, PickScore
from .combine import CombinedReward, RewardEntry
from .consistency import Consistency
from .geneval import GenEvalReward
from .imagereward import ImageReward
from .jpeg import JpegCompressibility, JpegIncompressibility
from .nan_policy import NAN_POLICIES, NonFiniteRewardError, apply_nan_policy
from .ocr import OcrReward, edit_distance, ocr_score, quoted_text
from .registry import REWARDS, available_rewards, build_reward, register_reward, resolve_reward
from .remote import RemoteReward, RemoteRewardError, make_reward_server
from .shapes import PromptGrammarError, ShapesReward
from .video import FRAME_REDUCTIONS, FrameReward, takes_video
from .vlm import VlmReward, VlmRewardError

__all__ = [
    "Aesthetic",
    "AestheticMLP",
    "AsyncReward",
    "BaseReward",
    "Brightness",
    "ClipScore",
    "CombinedReward",
    "Consistency",
    "FRAME_REDUCTIONS",
    "FrameReward",
    "GenEvalReward",
    "HPSv2",
    "ImageReward",
    "JpegCompressibility",
    "JpegIncompressibility",
    "ModelReward",
    "NAN_POLICIES",
    "NonFiniteRewardError",
    "OcrReward",
    "PickScore",
    "PromptGrammarError",
    "REWARDS",
    "RemoteReward",
    "RemoteRewardError",
    "Reward",
    "RewardEntry",
    "RewardError",
    "ShapesReward",
    "VlmReward",
    "VlmRewardError",
    "apply_nan_policy",
    "available_rewards",
    "build_reward",
    "check_inputs",
    "edit_distance",
    "make_reward_server",
    "ocr_score",
    "quoted_text",
    "register_reward",
    "resolve_reward",
    "takes_video",
]
