"""Train a tiny Qwen2-style byte-level BPE and save it in the `CosyVoice-BlankEN` file layout.

No real Qwen2 tokenizer files exist offline, so the tiny test/demo model uses this one. The output
directory holds `vocab.json`, `merges.txt` and `tokenizer_config.json` exactly as a Qwen2 checkpoint does
(BPE entries first, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as added tokens), so
`TextTokenizer.from_dir` reads it with the same code path as the real vocabulary and appends the 17
CosyVoice specials after them. Total vocabulary, specials included, is at most 4096.

Usage (from the repo root, with the package importable):
    PYTHONPATH=. python recipes/tiny_tokenizer.py [--out vocalis/assets/tokenizer] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import pre_tokenizers, trainers
from tokenizers.models import BPE

from vocalis.frontend.tokenizer import COSYVOICE_SPECIAL_TOKENS, QWEN_SPECIAL_TOKENS, qwen2_pipeline

CORPUS_EN = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Good morning! How are you today? I am fine, thank you, and you? The weather is lovely this afternoon.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
Please call me back at your earliest convenience; I will be waiting by the phone until seven o'clock.
In the beginning there was nothing but silence, and then the music started playing softly in the hall.
Speech synthesis turns written text into natural sounding audio. Modern systems use neural networks
that predict discrete speech tokens and then render a waveform with a vocoder.
Twenty one, thirty two, forty three, fifty four, sixty five, seventy six, eighty seven, ninety eight.
One hundred and twenty three thousand four hundred and fifty six. The first, the second and the third.
It costs twelve dollars and fifty cents. The meeting starts at half past nine on Monday, the fifth of May.
I can't believe it's already December! We're going to the mountains, and they'll meet us there.
What time is it? It's a quarter to eleven. Would you like some tea or coffee? Yes, please, with milk.
Reading books, listening to podcasts and talking with friends are great ways to learn a language.
The children laughed loudly when the clown slipped on the banana peel, and everyone clapped.
Scientists discovered a new species of frog in the rainforest, which glows faintly in the dark.
"Where are you going?" she asked. "Home," he replied, "because it is getting late and cold."
The train leaves from platform four at 8:15 and arrives in the city at 10:40 in the evening.
Temperatures reached 35 degrees, and about 2,500 people gathered in the park on July 4th, 2024.
My phone number is 555 0199, and the office is on the 3rd floor of building 12B.
Please remember to breathe slowly, relax your shoulders and smile; everything is going to be fine.
"""

CORPUS_ZH = """\
今天天气很好，我们一起去公园散步吧。你好，很高兴认识你！请问你叫什么名字？
在他讲述那个荒诞故事的过程中，他突然停下来，因为他自己也被逗笑了。
收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
希望你以后能够做的比我还好呦。我们走的每一步，都是我们策略的一部分。
语音合成技术可以把文字转换成自然流畅的声音，现代系统使用神经网络来预测语音单元。
今天是二零二四年三月五日，气温二十五点五度。一二三四五六七八九十，百千万亿。
北京是中国的首都，上海是一座国际化的大都市，广州和深圳位于南方。
春天来了，花儿开了，小鸟在树上唱歌，孩子们在草地上快乐地奔跑。
请用四川话说这句话。他说：“明天见。”然后转身离开了。学习中文需要耐心和坚持。
这家餐厅的菜很好吃，价格也不贵，服务员非常热情，我们下次还会再来。
会议将在下午三点开始，请大家准时参加，并提前准备好相关的材料和问题。
人工智能正在改变我们的生活方式，从智能手机到自动驾驶汽车，无处不在。
"""

CORPUS_JA = """\
今日はとても良い天気ですね。一緒に公園を散歩しませんか？はじめまして、どうぞよろしくお願いします。
音声合成は文字を自然な音声に変換する技術です。東京は日本の首都で、大阪は食べ物がおいしい町です。
ありがとうございます。すみません、駅はどこですか？まっすぐ行って、二つ目の角を右に曲がってください。
桜の花が咲いて、春が来ました。子供たちは元気に遊んでいます。コーヒーとお茶、どちらがいいですか？
明日の会議は午後三時から始まります。資料を準備しておいてください。カタカナとひらがなを勉強しています。
"""

CORPUS_NUMBERS = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 42 50 64 75 99 100 128 256 512 1000 1024
2023 2024 2025 3.14 2.5 0.5 12.50 $5 $12.50 50% 75% 1/2 3/4 10:30 5:30pm 8:15am 12:00 1,000 2,500 10,000
1st 2nd 3rd 4th 5th 21st 22nd 100th +86 138 0013 8000 (555) 0199 #1 No. 7 v2.0 x = 5 + 3 - 1 * 2 / 4
"""


def corpus_lines() -> list[str]:
    text = CORPUS_EN + CORPUS_ZH + CORPUS_JA + CORPUS_NUMBERS
    return [line for line in text.splitlines() if line.strip()]


def tokenizer_config(base_vocab_size: int) -> dict:
    """`tokenizer_config.json` in the Qwen2 layout: the three native specials right after the BPE entries."""
    added = {
        str(base_vocab_size + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(QWEN_SPECIAL_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build(out: Path, vocab_size: int = 4096) -> int:
    """Train and save; returns the number of BPE entries (specials excluded)."""
    num_new_specials = len(COSYVOICE_SPECIAL_TOKENS) - 2  # <|im_start|>/<|im_end|> are Qwen natives
    bpe_size = vocab_size - len(QWEN_SPECIAL_TOKENS) - num_new_specials
    tokenizer = qwen2_pipeline(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(out))
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    config = tokenizer_config(base)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "vocalis/assets/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=4096, help="total size including all specials")
    args = parser.parse_args()
    base = build(args.out, args.vocab_size)
    print(f"wrote {args.out}: {base} BPE entries + {len(QWEN_SPECIAL_TOKENS)} Qwen specials")


if __name__ == "__main__":
    main()
